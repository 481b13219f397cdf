"""streaming: time to first audio (TTFA) at the gateway, talker -> vocoder window 25 vs -1.

A streamed chat completion with text and audio; TTFA is the time from sending the request to
the first chunk that carries audio, read with a plain SSE client. With window 25 the vocoder
starts on the talker's first 25 codec frames; with -1 it waits for the talker's last one. Each
setting serves its own pipeline (`omni serve`); requests run one at a time after a warm-up.

- synthetic: thinker -> talker -> vocoder at realistic rates for a GPU deployment: the thinker
  at 100 tokens/s (200 tokens), the talker at 4 codec frames per text token and 200 frames/s,
  the vocoder 20 ms per call plus 0.5 ms per frame, 480 samples (20 ms at 24 kHz) per frame.
- demo: the tiny random-weight Qwen2 thinker and talker and the conv vocoder on this CPU
  (`omni models init-demo`), the same 200 thinker tokens (800 talker frames).

Ratio: ttfa_window_vs_full = median TTFA at window 25 / at -1, synthetic (goal <= 0.08; vllm-omni
reports 523 ms vs 6459 ms, 0.081, on an H800); ttfa_window_vs_full_demo likewise.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import bars, figure, machine, median, parser, report, rounds, save
from bench.load import chat
from bench.omni_stream import streamed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (25, -1)
SYNTHETIC_ROUNDS = 5
DEMO_ROUNDS = 5


def synthetic(window: int, tokens: int = 200) -> dict[str, Any]:
    return {
        "servedModelName": "bench",
        "connectors": {"default": {"kind": "shm"}},
        "gateway": {"requestTimeoutS": 120},
        "stages": [
            {
                "name": "thinker",
                "engine": {
                    "kind": "synthetic",
                    "args": {"unitsPerCall": tokens, "msPerUnit": 10, "hiddenSize": 64},
                },
                "inputs": [{"from": "request"}],
                "finalOutput": "text",
                "maxSegmentUnits": 4,
            },
            {
                "name": "talker",
                "engine": {"kind": "synthetic", "args": {"unitsPerInputUnit": 4, "msPerUnit": 5}},
                "inputs": [{"from": "thinker", "window": 8}],
                "maxSegmentUnits": 25,
            },
            {
                "name": "vocoder",
                "engine": {
                    "kind": "synthetic",
                    "args": {"msPerCall": 20, "msPerUnit": 0.5, "samplesPerUnit": 480},
                },
                "inputs": [{"from": "talker", "window": window}],
                "finalOutput": "audio",
            },
        ],
    }


def demo(window: int, tokens: int = 200) -> dict[str, Any]:
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    spec["stages"][0]["sampling"]["max_tokens"] = tokens
    spec["stages"][2]["inputs"][0]["window"] = window
    return spec


async def ttfa(base: str) -> float:
    """Seconds to the first audio chunk of one streamed request (which is then read to the end)."""
    body = chat(
        "Tell me a story.",
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return (await streamed(session, base, body))["audio_ttfp"]


async def ttfas(base: str, rounds: int) -> list[float]:
    await ttfa(base)  # warm-up
    return [await ttfa(base) for _ in range(rounds)]


def measure(name: str, make: Any, rounds: int, cwd: Path | None = None) -> dict[str, float]:
    out = {}
    for w in WINDOWS:
        with served("bench", make(w), cwd=cwd) as base:
            out[str(w)] = round(median(asyncio.run(ttfas(base, rounds))) * 1000, 1)
    return out


def plot(result: dict[str, Any], path: Any) -> None:
    fig, ax = figure()
    names = list(result["ttfa_ms"])
    series = {f"window {w}": [result["ttfa_ms"][n][w] for n in names] for w in ("25", "-1")}
    bars(ax, names, series, "time to first audio, ms", "TTFA: talker -> vocoder window 25 vs full (-1)")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    tokens = 40 if args.quick else 200
    results = {
        "synthetic": measure("synthetic", lambda w: synthetic(w, tokens), rounds(SYNTHETIC_ROUNDS, args))
    }
    with demo_models() as cwd:
        results["demo"] = measure("demo", lambda w: demo(w, tokens), rounds(DEMO_ROUNDS, args), cwd)
    result = {
        "benchmark": "streaming",
        "machine": machine(),
        "ttfa_ms": results,
        "ratios": {
            "ttfa_window_vs_full": round(results["synthetic"]["25"] / results["synthetic"]["-1"], 3),
            "ttfa_window_vs_full_demo": round(results["demo"]["25"] / results["demo"]["-1"], 3),
        },
    }
    rows = [(f"{n} TTFA ms", f"window 25: {r['25']}   window -1: {r['-1']}") for n, r in results.items()]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("streaming", rows, result, args, plot)


if __name__ == "__main__":
    main()
