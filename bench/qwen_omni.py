"""qwen-omni: Qwen2.5-Omni served (examples/qwen2.5-omni.yaml, the tiny checkpoint, this CPU):
audio time to first packet, real-time factor and request throughput, as vLLM-Omni defines them
(`vllm bench serve --omni`; bench.omni_stream): TTFT is the time from sending a streamed chat
completion to its first text token, TTFP to its first audio chunk; RTF is the time to its last
audio chunk over the seconds of audio it returned; throughput is requests completed per second
at a concurrency.

Each request: the same prompt, 200 thinker tokens, up to 400 talker codes (8 s of audio at
most; the random talker ends where its greedy pick is a stop code), greedy, voice Ethan,
streamed as 16-bit PCM.

Ratios, each against a baseline measured in the same run:
- ttfp_window_vs_full: median TTFP with code2wav in chunks of 12 codes (the example) over
  code2wav on the whole code sequence (`chunkCodes: 0`, `window: -1`), at concurrency 1.
  Goal <= 0.15.
- throughput_c8_vs_c1: requests/s at concurrency 8 over concurrency 1 (goal >= 4), the stages
  batching the steps of concurrent requests (their default).
- streamed_vs_whole_throughput_c1: requests/s at concurrency 1 with code2wav in chunks over
  the same on the whole sequence: what streaming costs (goal >= 0.9).
- rtf_c8: the median RTF at concurrency 8, chunked (goal < 1: audio comes faster than it plays).
- ttfp_c8_vs_c1: median TTFP at concurrency 8 over concurrency 1 (goal <= 2.5).
- throughput_c16_vs_c1, rtf_c16 (not with --quick): the same at concurrency 16.
- c8_batched_vs_unbatched: requests/s at concurrency 8 with batching over the same with it
  off in every stage (`maxBatch: 1`): the baseline batching is measured against.
- c8_vllm_thinker_vs_transformers (not with --quick): requests/s at concurrency 8 with the
  thinker on vLLM (examples/qwen2.5-omni-vllm.yaml) over the transformers thinker.
- c1_compiled_vs_eager, c8_compiled_vs_eager, ttfp_c8_vs_c1_compiled (not with --quick):
  requests/s with `compile: true` on the talker and code2wav over the same without, at
  concurrency 1 and 8, and ttfp_c8_vs_c1 with it.

Qwen3-Omni (examples/qwen3-omni.yaml), the same requests, its first audio after one code
(code2wav's first piece, sized by the load; docs/models.md, First audio) against its first
audio with the first 12-code chunk (`firstChunkCodes: 12`, no `firstWindow`: before issue 53),
printed last:
- ttfp_c1_smallest_vs_12: median TTFP at concurrency 1, one code over twelve (goal <= 0.5).
- c8_load_sized_vs_12: requests/s at concurrency 8, first pieces sized by the load over the
  first 12-code chunk (goal >= 0.95: under load the extra decoder calls cost little).
Qwen2.5-Omni's first chunk is already its smallest (a DiT block and the one after it), so its
pair is under load alone (not with --quick), printed after them:
- qwen2.5_c8_load_sized_vs_12: requests/s at concurrency 8, the first chunk sized by the load
  (12 codes idle, up to 48 busy: the example's) over the first chunk at 12 codes however busy
  (`busyFirstChunkCodes: 12`) (goal >= 0.95).

Each run also says where the time went, stage by stage (bench.profile: busy share, mean
batch, queue wait, engine call, connector and (de)serialising time per request).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import bars, figure, machine, median, parser, report, rounds
from bench.load import chat
from bench.omni_stream import streamed
from bench.procs import demo_models, served
from bench.profile import profiled

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_RATE = 24000
ROUNDS = 5
THINKER_TOKENS = 200
TALKER_CODES = 400  # up to 8 s of audio: streaming matters for long answers


def served_example(example: str, codes: int) -> dict[str, Any]:
    """An example's spec as the benchmark serves it: the talker's budget `codes`, eight
    requests in every stage at once."""
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / example).read_text())["spec"])
    spec["servedModelName"] = "bench"
    spec["gateway"]["requestTimeoutS"] = 300
    for stage in spec["stages"]:
        stage["maxInflight"] = 8
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = codes
    return spec


def pipeline(
    chunked: bool,
    codes: int,
    batched: bool = True,
    vllm: bool = False,
    compiled: bool = False,
    busy_first: int | None = None,
) -> dict[str, Any]:
    """examples/qwen2.5-omni.yaml (or its vLLM thinker's); `busy_first`: code2wav's
    `busyFirstChunkCodes` (its first chunk under load; `maxChunkCodes` by default)."""
    spec = served_example("qwen2.5-omni-vllm.yaml" if vllm else "qwen2.5-omni.yaml", codes)
    if busy_first is not None:
        spec["stages"][2]["engine"]["args"]["busyFirstChunkCodes"] = busy_first
    for stage in spec["stages"]:
        if not batched and stage["engine"]["kind"] != "vllm":  # vLLM's batching is its own
            stage["engine"]["args"]["maxBatch"] = 1
        if compiled and stage["name"] in ("talker", "code2wav"):
            stage["engine"]["args"]["compile"] = True
    if not chunked:
        code2wav = spec["stages"][2]
        code2wav["engine"]["args"]["chunkCodes"] = 0
        code2wav["inputs"][0]["window"] = -1
    return spec


def qwen3_pipeline(codes: int, smallest: bool) -> dict[str, Any]:
    """examples/qwen3-omni.yaml; `smallest`: as it is (the first audio after one code, more
    under load), else the first audio with the first whole chunk (12 codes)."""
    spec = served_example("qwen3-omni.yaml", codes)
    if not smallest:
        code2wav = next(stage for stage in spec["stages"] if stage["name"] == "code2wav")
        code2wav["engine"]["args"]["firstChunkCodes"] = code2wav["engine"]["args"]["chunkCodes"]
        code2wav["inputs"][0].pop("firstWindow")
    return spec


async def one(session: aiohttp.ClientSession, base: str, tokens: int) -> dict[str, float]:
    """One streamed request, measured as vLLM-Omni measures it (bench.omni_stream)."""
    body = chat(
        "Tell me about the sea.",
        stream=True,
        max_tokens=tokens,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
    )
    return await streamed(session, base, body)


async def load(base: str, concurrency: int, requests: int, tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        done, wall, stages = await profiled(base, lambda: one(session, base, tokens), concurrency, requests)
    return {
        "ttft_ms": round(median([d["ttft"] for d in done]) * 1000, 1),
        "ttfp_ms": round(median([d["audio_ttfp"] for d in done]) * 1000, 1),
        "rtf": round(median([d["audio_rtf"] for d in done]), 3),
        "audio_s": round(median([d["audio_s"] for d in done]), 3),
        "req_per_s": round(len(done) / wall, 3),
        "stages": stages,
    }


def plot(result: dict[str, Any], path: Any) -> None:
    fig, (a, b, c) = figure(3)
    runs = result["runs"]
    ttfp = [
        k
        for k in ("chunked_c1", "chunked_c8", "compiled_c1", "compiled_c8", "full_c1", "vllm_thinker_c1")
        if k in runs
    ]
    bars(a, ["TTFP"], {k: [runs[k]["ttfp_ms"]] for k in ttfp}, "TTFP, ms", "streamed vs whole, c1 vs c8")
    rate = [
        k
        for k in (
            "chunked_c1",
            "full_c1",
            "compiled_c1",
            "unbatched_c8",
            "chunked_c8",
            "compiled_c8",
            "chunked_c16",
            "vllm_thinker_c8",
        )
        if k in runs
    ]
    bars(b, ["req/s"], {k: [runs[k]["req_per_s"]] for k in rate}, "requests/s", "c1, c8 and c16")
    rtf = [k for k in ("chunked_c1", "chunked_c8", "chunked_c16", "unbatched_c8") if k in runs]
    bars(c, ["RTF"], {k: [runs[k]["rtf"]] for k in rtf}, "RTF", "RTF (< 1: faster than it plays)")
    c.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    from bench.common import save

    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    n = rounds(ROUNDS, args)
    tokens, codes = (16, 24) if args.quick else (THINKER_TOKENS, TALKER_CODES)
    runs: dict[str, dict[str, Any]] = {}
    with demo_models() as cwd:
        with served("bench", pipeline(True, codes), cwd=cwd) as base:
            runs["chunked_c1"] = asyncio.run(load(base, 1, n, tokens))
            runs["chunked_c8"] = asyncio.run(load(base, 8, 8 if args.quick else 8 * n, tokens))
            if not args.quick:
                runs["chunked_c16"] = asyncio.run(load(base, 16, 16 * n, tokens))
        if not args.quick:  # the first chunk 12 codes however busy: before issue 53
            with served("bench", pipeline(True, codes, busy_first=12), cwd=cwd) as base:
                runs["first_12_c8"] = asyncio.run(load(base, 8, 8 * n, tokens))
        with served("bench", pipeline(True, codes, batched=False), cwd=cwd) as base:
            runs["unbatched_c8"] = asyncio.run(load(base, 8, 8 if args.quick else 8 * n, tokens))
        with served("bench", pipeline(False, codes), cwd=cwd) as base:
            runs["full_c1"] = asyncio.run(load(base, 1, n, tokens))
        if not args.quick:
            with served("bench", pipeline(True, codes, vllm=True), cwd=cwd) as base:
                runs["vllm_thinker_c1"] = asyncio.run(load(base, 1, n, tokens))
                runs["vllm_thinker_c8"] = asyncio.run(load(base, 8, 8 * n, tokens))
            with served("bench", pipeline(True, codes, compiled=True), cwd=cwd) as base:
                runs["compiled_c1"] = asyncio.run(load(base, 1, n, tokens))
                runs["compiled_c8"] = asyncio.run(load(base, 8, 8 * n, tokens))
        for smallest, name in ((True, "qwen3_smallest"), (False, "qwen3_12")):
            with served("bench", qwen3_pipeline(codes, smallest), cwd=cwd) as base:
                runs[f"{name}_c1"] = asyncio.run(load(base, 1, n, tokens))
                runs[f"{name}_c8"] = asyncio.run(load(base, 8, 8 if args.quick else 8 * n, tokens))
    result = {
        "benchmark": "qwen-omni",
        "machine": machine(),
        "runs": runs,
        "ratios": {
            "ttfp_window_vs_full": round(runs["chunked_c1"]["ttfp_ms"] / runs["full_c1"]["ttfp_ms"], 3),
            "throughput_c8_vs_c1": round(
                runs["chunked_c8"]["req_per_s"] / runs["chunked_c1"]["req_per_s"], 3
            ),
            "c8_batched_vs_unbatched": round(
                runs["chunked_c8"]["req_per_s"] / runs["unbatched_c8"]["req_per_s"], 3
            ),
            "streamed_vs_whole_throughput_c1": round(
                runs["chunked_c1"]["req_per_s"] / runs["full_c1"]["req_per_s"], 3
            ),
            "rtf_c8": runs["chunked_c8"]["rtf"],
            "ttfp_c8_vs_c1": round(runs["chunked_c8"]["ttfp_ms"] / runs["chunked_c1"]["ttfp_ms"], 3),
        },
    }
    if "chunked_c16" in runs:
        result["ratios"]["throughput_c16_vs_c1"] = round(
            runs["chunked_c16"]["req_per_s"] / runs["chunked_c1"]["req_per_s"], 3
        )
        result["ratios"]["rtf_c16"] = runs["chunked_c16"]["rtf"]
    if "vllm_thinker_c8" in runs:
        result["ratios"]["c8_vllm_thinker_vs_transformers"] = round(
            runs["vllm_thinker_c8"]["req_per_s"] / runs["chunked_c8"]["req_per_s"], 3
        )
    if "compiled_c8" in runs:
        for c in (1, 8):
            result["ratios"][f"c{c}_compiled_vs_eager"] = round(
                runs[f"compiled_c{c}"]["req_per_s"] / runs[f"chunked_c{c}"]["req_per_s"], 3
            )
        result["ratios"]["ttfp_c8_vs_c1_compiled"] = round(
            runs["compiled_c8"]["ttfp_ms"] / runs["compiled_c1"]["ttfp_ms"], 3
        )
    result["ratios"]["ttfp_c1_smallest_vs_12"] = round(
        runs["qwen3_smallest_c1"]["ttfp_ms"] / runs["qwen3_12_c1"]["ttfp_ms"], 3
    )
    result["ratios"]["c8_load_sized_vs_12"] = round(
        runs["qwen3_smallest_c8"]["req_per_s"] / runs["qwen3_12_c8"]["req_per_s"], 3
    )
    if "first_12_c8" in runs:
        result["ratios"]["qwen2.5_c8_load_sized_vs_12"] = round(
            runs["chunked_c8"]["req_per_s"] / runs["first_12_c8"]["req_per_s"], 3
        )
    rows = [(name, "  ".join(f"{k} {v}" for k, v in r.items() if k != "stages")) for name, r in runs.items()]
    rows += [
        (f"{name} {stage}", "  ".join(f"{k} {v}" for k, v in figures.items()))
        for name, r in runs.items()
        for stage, figures in r["stages"].items()
    ]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("qwen_omni", rows, result, args, plot)


if __name__ == "__main__":
    main()
