"""tts: Qwen3-TTS served (examples/qwen3-tts.yaml on the tiny CustomVoice checkpoint, this CPU)
against the reference package's own `generate_custom_voice` (qwen-tts, in .venv-qwen-tts) on
the same checkpoint and text, both greedy, in the same run.

Each request: the same text, voice vivian, 48 frames of codes (3.8 s of audio; the random
talker never draws its eos, so every request makes exactly that), raw 16-bit PCM streamed from
/v1/audio/speech. First audio: from sending the request to its first audio bytes; whole: to
its last; RTF: whole over the seconds of audio. The reference's time is one
`generate_custom_voice` call (it does not stream: its first audio is its whole time).

Ratios (goals from the issue):
- c1_whole_vs_reference: our median whole request at concurrency 1 over the reference's median
  call on the same text (goal <= 1.1).
- c1_first_audio_vs_reference: our median first audio at concurrency 1 over the reference's
  whole call (goal <= 0.25; the example's first audio comes after the talker's first code).
- c8_vs_reference_batched: our requests/s at concurrency 8 over the reference's batched
  `generate_custom_voice` of 8 texts (8 / its time) (goal >= 1).
- throughput_c8_vs_c1: our requests/s at concurrency 8 over concurrency 1.
- rtf_c1, rtf_c8: our median RTF (< 1: audio comes faster than it plays).

Each run also says where the time went, stage by stage (bench.profile: busy share, mean batch,
queue wait, engine call, connector and (de)serialising time per request).
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import machine, median, parser, report, rounds
from bench.procs import ROOT, demo_models, served
from bench.profile import profiled
from bench.qwen_tts_reference import qwen_tts_reference

ROUNDS = 5
FRAMES = 48
TEXT = "Hello there. The sea is calm tonight, and the wind has dropped."
VOICE = "vivian"
SAMPLE_RATE = 24000


def pipeline(frames: int) -> dict[str, Any]:
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "qwen3-tts.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    spec["gateway"]["requestTimeoutS"] = 300
    spec["stages"][0]["sampling"]["max_tokens"] = frames + 1  # the last code 0 makes no frame
    for stage in spec["stages"]:  # the example's one-line change: the CustomVoice checkpoint
        stage["engine"]["model"] = "./models/tiny-qwen3-tts"
    return spec


async def one(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    body = {"model": "bench", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
    first = None
    size = 0
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/audio/speech", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {(await r.read())[:500]!r}")
        async for data in r.content.iter_any():
            if data and first is None:
                first = time.perf_counter() - t0
            size += len(data)
    whole = time.perf_counter() - t0
    if first is None or not size:
        raise RuntimeError("the response carried no audio")
    return {"first_audio_s": first, "whole_s": whole, "audio_s": size / 2 / SAMPLE_RATE}


async def load(base: str, concurrency: int, requests: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        done, wall, stages = await profiled(base, lambda: one(session, base), concurrency, requests)
    return {
        "first_audio_ms": round(median([d["first_audio_s"] for d in done]) * 1000, 1),
        "whole_ms": round(median([d["whole_s"] for d in done]) * 1000, 1),
        "rtf": round(median([d["whole_s"] / d["audio_s"] for d in done]), 3),
        "audio_s": round(median([d["audio_s"] for d in done]), 3),
        "req_per_s": round(len(done) / wall, 3),
        "stages": stages,
    }


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    n = rounds(ROUNDS, args)
    frames = 6 if args.quick else FRAMES
    with demo_models() as cwd:
        checkpoint = cwd / "models" / "tiny-qwen3-tts"
        with tempfile.TemporaryDirectory() as tmp:
            timed = {"texts": [TEXT] * 8, "speaker": VOICE, "rounds": n}
            asked = {"checkpoint": str(checkpoint), "timed": timed, "max_new_tokens": frames + 1}
            reference = qwen_tts_reference(asked, Path(tmp))["timed"]
        with served("bench", pipeline(frames), cwd=cwd) as base:
            c1 = asyncio.run(load(base, 1, n))
            c8 = asyncio.run(load(base, 8, 8 * n))
    alone_ms = round(median(reference["alone_s"]) * 1000, 1)
    batch_ms = round(median(reference["batch_s"]) * 1000, 1)
    result = {
        "benchmark": "tts",
        "machine": machine(),
        "frames": frames,
        "runs": {"c1": c1, "c8": c8, "reference": {"alone_ms": alone_ms, "batch_of_8_ms": batch_ms}},
        "ratios": {
            "c1_whole_vs_reference": round(c1["whole_ms"] / alone_ms, 3),
            "c1_first_audio_vs_reference": round(c1["first_audio_ms"] / alone_ms, 3),
            "c8_vs_reference_batched": round(c8["req_per_s"] / (8 / (batch_ms / 1000)), 3),
            "throughput_c8_vs_c1": round(c8["req_per_s"] / c1["req_per_s"], 3),
            "rtf_c1": c1["rtf"],
            "rtf_c8": c8["rtf"],
        },
    }
    rows = [
        (name, "  ".join(f"{k} {v}" for k, v in r.items() if k != "stages"))
        for name, r in result["runs"].items()
    ]
    rows += [
        (f"{name} {stage}", "  ".join(f"{k} {v}" for k, v in figures.items()))
        for name in ("c1", "c8")
        for stage, figures in result["runs"][name]["stages"].items()
    ]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("tts", rows, result, args)


if __name__ == "__main__":
    main()
