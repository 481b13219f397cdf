"""epd: Qwen2.5-Omni's encoders in a stage of their own (examples/qwen2.5-omni-epd.yaml) against
the encoders inside the thinker (examples/qwen2.5-omni.yaml), tiny checkpoint, this CPU.

Each request: one audio clip (10 s, 16 kHz) and one photo-sized image (1280x720: 1196 merged
patches), a question, 32 thinker tokens, greedy, text only (what the thinker does is what is
measured), not streamed; closed-loop at concurrency 8, 25 rounds of 8 requests.

Ratios, each against a baseline measured in the same run:
- thinker_throughput_split_vs_in_thinker: requests the thinker serves per second of its own
  compute (its process's CPU time over the load; one torch thread, so its busy time) with the
  encoders split out, over the same with the thinker running its own encoders: what the
  split frees on the thinker's device.
- e2e_split_vs_in_thinker: requests/s end to end, one encoder replica, over the unsplit
  pipeline.
- encoder_replicas_2_vs_1: requests/s end to end with two encoder replicas over one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import soundfile
import yaml
from PIL import Image

from bench.common import bars, figure, machine, median, parser, report, rounds
from bench.load import closed_loop
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 25
CONCURRENCY = 8
TOKENS = 32


def pipeline(split: bool, encoders: int = 1) -> dict[str, Any]:
    example = "qwen2.5-omni-epd.yaml" if split else "qwen2.5-omni.yaml"
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / example).read_text())["spec"])
    spec["servedModelName"] = "bench"
    spec["gateway"]["requestTimeoutS"] = 300
    for stage in spec["stages"]:
        stage["maxInflight"] = CONCURRENCY
        if stage["name"] == "encoder":
            stage["replicas"] = encoders
    return spec


def body(quick: bool = False) -> dict[str, Any]:
    """One chat completion with a clip and an image (a tone in noise, random pixels: a seed);
    with --quick, a second of audio and a small image (it checks that the benchmark runs)."""
    rng = np.random.default_rng(0)
    seconds, (height, width), tokens = (1, (180, 320), 8) if quick else (10, (720, 1280), TOKENS)
    t = np.arange(seconds * 16000) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    wav, png = io.BytesIO(), io.BytesIO()
    soundfile.write(wav, clip, 16000, format="WAV", subtype="FLOAT")
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(png, format="PNG")
    b64 = lambda buf: base64.b64encode(buf.getvalue()).decode()  # noqa: E731
    content = [
        {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png)}"}},
        {"type": "text", "text": "What do you hear and see?"},
    ]
    return {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": tokens}


def thinker_process() -> psutil.Process:
    """The thinker's stage process (it names itself so), of the one pipeline this benchmark
    serves: among its own descendants, not another's on the same machine."""
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith("omni: stage thinker replica 0"):
                return proc
    raise LookupError("no thinker stage process")


def measure(base: str, requests: int, quick: bool) -> dict[str, float]:
    asked = body(quick)
    if not quick:  # --quick checks that it runs, not how fast
        asyncio.run(closed_loop(base, asked, CONCURRENCY, CONCURRENCY))  # warm-up
    thinker = thinker_process()
    before = sum(thinker.cpu_times()[:2])
    load = asyncio.run(closed_loop(base, asked, requests, CONCURRENCY))
    busy = sum(thinker.cpu_times()[:2]) - before
    return {
        "req_per_s": round(load.per_s, 3),
        "latency_p50_ms": round(median(load.latencies_s) * 1000, 1),
        "thinker_cpu_ms_per_request": round(busy / requests * 1000, 1),
    }


def plot(result: dict[str, Any], path: Any) -> None:
    fig, (a, b) = figure(2)
    runs = result["runs"]
    bars(a, ["c8"], {k: [v["req_per_s"]] for k, v in runs.items()}, "requests/s", "end to end")
    cpu = {k: [v["thinker_cpu_ms_per_request"]] for k, v in runs.items()}
    bars(b, ["c8"], cpu, "ms", "thinker CPU per request")
    from bench.common import save

    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    requests = CONCURRENCY * rounds(ROUNDS, args) // (2 if args.quick else 1)
    runs: dict[str, dict[str, float]] = {}
    with demo_models() as cwd:
        for name, spec in (
            ("in_thinker", pipeline(False)),
            ("split_1_encoder", pipeline(True, 1)),
            ("split_2_encoders", pipeline(True, 2)),
        ):
            with served("bench", spec, cwd=cwd) as base:
                runs[name] = measure(base, requests, args.quick)
    rate = {k: v["req_per_s"] for k, v in runs.items()}
    thinker = {k: v["thinker_cpu_ms_per_request"] for k, v in runs.items()}
    result = {
        "benchmark": "epd",
        "machine": machine(),
        "runs": runs,
        "ratios": {
            "thinker_throughput_split_vs_in_thinker": round(
                thinker["in_thinker"] / thinker["split_1_encoder"], 3
            ),
            "e2e_split_vs_in_thinker": round(rate["split_1_encoder"] / rate["in_thinker"], 3),
            "encoder_replicas_2_vs_1": round(rate["split_2_encoders"] / rate["split_1_encoder"], 3),
        },
    }
    rows = [(name, "  ".join(f"{k} {v}" for k, v in r.items())) for name, r in runs.items()]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("epd", rows, result, args, plot)


if __name__ == "__main__":
    main()
