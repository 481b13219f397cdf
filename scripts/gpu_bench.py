"""Qwen3-Omni, Qwen2.5-Omni and Qwen3-TTS at their real sizes on a GPU: first audio packet,
real-time factor, requests per second at concurrency 1, 8 and 16, and GPU memory per stage, as
one prepared run of under 10 minutes (docs/benchmarks.md, "GPU").

The machine it is written for has torch and transformers but no network, no NATS and a disk
smaller than Qwen3-Omni's checkpoint (70 GB): so a pipeline's three stages run here in one
process, each its real engine (omni_stage's, built from examples/PIPELINE.yaml as a stage
builds it, with its own compute thread and step batcher; bench.in_process), fed window by
window as the pipeline feeds them (the example's windows: 4 thinker tokens, 12 codes; for
Qwen3-TTS the first code alone, then 25), on a config-only checkpoint at the real model's
sizes (Qwen3-TTS: 12Hz-1.7B-CustomVoice) with `loadFormat: dummy` (random weights built on
the device). The gateway, NATS and the shared-memory connector are left out: on one
node they add about a millisecond a hop (docs/benchmarks.md, "hop"); and the stages share one
Python interpreter here, where `omni serve` gives each its own process.

Figures as vLLM-Omni defines them: TTFP from a request's start to its first audio chunk; RTF
from its start to its last chunk over the seconds of audio; requests/s completed at a
concurrency; TTFT from its start to the first stage's first output (a thinker's token, the
TTS talker's first frame). Each request: the same prompt, `--tokens` thinker tokens
(min_tokens = max_tokens: random weights would end at random), up to `--codes` codes (the
talker may draw its end code sooner), greedy.

Not part of the suite (CI has no GPU). From the repository root, the project importable:
    python scripts/gpu_bench.py OUT.json [--pipeline qwen3-omni|qwen2.5-omni|qwen3-tts] [--sizes full|tiny]
`--sizes tiny` runs the same on the demo's dimensions (a check of the script on a CPU, where
`--cuda-graphs` runs the same steps at fixed shapes, uncaptured: `fixedSteps`);
`--cuda-graphs` runs the talker and the thinker with `cudaGraphs: true` (their decode steps
graphed, at fixed shapes on their slot tables, allocated and captured at load: the thinker's
of `maxModelLen` 512 positions a slot, the talker's 1024; and Qwen3-Omni's and Qwen3-TTS's
code predictor's frames); `captured` says which
stages' steps were captured (a capture the device refuses falls back to the same steps
launched, with a warning in the log), and `slot_steps` how each stage's decode steps ran
(`replayed`, `fixed` launched, `own`: the table's own shapes).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from bench.in_process import calls, stage_engine, windows
from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import Engine, EngineCall
from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.models.qwen2_5_omni import checkpoint as qwen2_5_omni
from omni_stage.models.qwen3_omni import checkpoint as qwen3_omni
from omni_stage.models.qwen3_tts import checkpoint as qwen3_tts
from omni_stage.payload import Payload
from omni_stage.segments import EngineOutput

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OMNI: dict[str, Any] = {"qwen3-omni": qwen3_omni, "qwen2.5-omni": qwen2_5_omni}
"""Each omni pipeline's example (examples/NAME.yaml) and the module writing its config-only checkpoint."""
TTS = "qwen3-tts"
TTS_RELEASE = "qwen3-tts-1.7b-customvoice"
PIPELINES = (*OMNI, TTS)
THINKER_WINDOW, TALKER_WINDOW = 4, 12  # the omni examples' windows
TTS_FIRST_WINDOW, TTS_WINDOW = 1, 25  # examples/qwen3-tts.yaml's
GRAPHED: dict[str, dict[str, Any]] = {
    "talker": {"cudaGraphs": True, "maxModelLen": 1024},  # (its prompt and 400 codes fit)
    "thinker": {"cudaGraphs": True, "maxModelLen": 512},  # (its prompt and 64 tokens fit)
}
"""The stages' arguments with `--cuda-graphs`."""
SAMPLE_RATE = 24000
PROMPT = "Tell me about the sea."


def stages(pipeline: str) -> tuple[str, ...]:
    return ("talker", "code2wav") if pipeline == TTS else ("thinker", "talker", "code2wav")


def config_only(pipeline: str, full: bool, into: Path) -> Path:
    """The pipeline's config-only checkpoint: at the real sizes, or at the demo's with the real
    vocabulary (replies hold ids past the demo tokenizer's)."""
    if pipeline == TTS:
        return qwen3_tts.write_config_only(into, TTS_RELEASE, None if full else qwen3_tts.TINY)
    family = OMNI[pipeline]
    tiny = dataclasses.replace(family.TINY, thinker_vocab=family.FULL_SIZE.thinker_vocab)
    return family.write_config_only(into, family.FULL_SIZE if full else tiny)  # type: ignore[no-any-return]


async def one(engines: dict[str, Engine], rid: str, tokens: int, codes: int) -> dict[str, float]:
    """One request through the stages; its times from its start."""
    talker, code2wav = engines["talker"], engines["code2wav"]
    t0 = time.perf_counter()
    spoken: asyncio.Queue[tuple[Payload, bool]] = asyncio.Queue()
    times: dict[str, float] = {}

    async def first(outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
        async for out in outputs:
            times.setdefault("ttft", time.perf_counter() - t0)
            yield out

    samples = 0
    async with asyncio.TaskGroup() as tasks:
        if thinker := engines.get("thinker"):
            content = [{"type": "text", "text": PROMPT}]
            request = {"messages": [{"role": "user", "content": content}], "media": {}}
            sampling = Sampling(max_tokens=tokens, min_tokens=tokens)
            thought: asyncio.Queue[tuple[Payload, bool]] = asyncio.Queue()
            think = thinker.generate(EngineCall(rid, {"request": request}, True, sampling))
            speech = calls(talker, "thinker", rid, Sampling(max_tokens=codes, voice="Ethan"), thought)
            tasks.create_task(windows(first(think), THINKER_WINDOW, thought))
            tasks.create_task(windows(speech, TALKER_WINDOW, spoken))
        else:  # Qwen3-TTS: the talker reads the request's text (its default voice)
            call = EngineCall(rid, {"request": {"prompt": PROMPT}}, True, Sampling(max_tokens=codes))
            tasks.create_task(windows(first(talker.generate(call)), TTS_WINDOW, spoken, TTS_FIRST_WINDOW))
        async for out in calls(code2wav, "talker", rid, Sampling(), spoken):
            now = time.perf_counter() - t0
            times.setdefault("ttfp", now)
            times["last"] = now
            samples += int(out.data["audio"].numel())
    audio_s = samples / SAMPLE_RATE
    return {**times, "audio_s": audio_s, "rtf": times["last"] / audio_s}


async def load(
    engines: dict[str, Engine], concurrency: int, requests: int, tokens: int, codes: int
) -> dict[str, Any]:
    queue = list(range(requests))
    done: list[dict[str, float]] = []

    async def worker() -> None:
        while queue:
            done.append(await one(engines, f"c{concurrency}-{queue.pop()}", tokens, codes))

    busy = {s: e.compute_seconds() for s, e in engines.items()}
    utilization: list[int] = []
    sampler = asyncio.create_task(gpu_utilization(utilization))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    sampler.cancel()
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "ttft_ms": round(statistics.median(d["ttft"] for d in done) * 1000, 1),
        "ttfp_ms": round(statistics.median(d["ttfp"] for d in done) * 1000, 1),
        "rtf": round(statistics.median(d["rtf"] for d in done), 3),
        "audio_s": round(statistics.median(d["audio_s"] for d in done), 2),
        "req_per_s": round(len(done) / wall, 3),
        "wall_s": round(wall, 1),
        "busy_share": {s: round((e.compute_seconds() - busy[s]) / wall, 2) for s, e in engines.items()},
        "gpu_utilization": round(statistics.mean(utilization), 1) if utilization else None,
    }


async def gpu_utilization(into: list[int]) -> None:
    """The GPU's utilization (NVML: the share of time a kernel ran), every 100 ms, where NVML
    answers: how much of the time the device waited for the host."""
    if not torch.cuda.is_available():
        return
    while True:
        try:
            into.append(await asyncio.to_thread(torch.cuda.utilization))
        except (ModuleNotFoundError, RuntimeError):  # no pynvml, or NVML refused
            return
        await asyncio.sleep(0.1)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    model = config_only(a.pipeline, a.sizes == "full", Path(a.model_dir) / a.pipeline)
    cuda = a.device == "cuda"
    result: dict[str, Any] = {
        "pipeline": a.pipeline,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "sizes": a.sizes,
        "torch": torch.__version__,
        "thinker_tokens": a.tokens,
        "talker_codes": a.codes,
        "cuda_graphs": a.cuda_graphs,
        "memory_gib": {},
        "load_s": {},
        "runs": [],
    }
    engines: dict[str, Engine] = {}
    for name in stages(a.pipeline):
        before = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        dtype = "bfloat16" if cuda else "float32"
        args = GRAPHED.get(name, {}) if a.cuda_graphs else {}
        if not cuda:  # (a CPU captures nothing: the same steps at fixed shapes, uncaptured)
            args = {("fixedSteps" if k == "cudaGraphs" else k): v for k, v in args.items()}
        if name in ("thinker", "talker") and a.prefill_batch_tokens is not None:
            args = args | {"prefillBatchTokens": a.prefill_batch_tokens}
        engines[name] = stage_engine(
            EXAMPLES / f"{a.pipeline}.yaml",
            name,
            model,
            max(a.concurrency),
            device=a.device,
            dtype=dtype,
            loadFormat="dummy",
            **args,
        )
        await engines[name].start()
        result["load_s"][name] = round(time.perf_counter() - t0, 1)
        if cuda:
            result["memory_gib"][name] = round((torch.cuda.memory_allocated() - before) / 2**30, 2)
        print(f"{name} loaded in {result['load_s'][name]} s {result['memory_gib'].get(name, '')}", flush=True)
    result["prefill_batch_tokens"] = {  # (the stages' defaults, where not given)
        name: e.prefill_tokens  # type: ignore[attr-defined]
        for name, e in engines.items()
        if hasattr(e, "prefill_tokens")
    }
    result["captured"] = {
        name: e.stepper.captured  # type: ignore[attr-defined]
        for name, e in engines.items()
        if isinstance(getattr(e, "stepper", None), FixedSteps)
    }
    deadline = time.monotonic() + a.budget_s
    await one(engines, "warm-up", a.tokens, a.codes)
    for c in a.concurrency:
        if time.monotonic() > deadline:
            print(f"concurrency {c}: skipped, past the time budget", flush=True)
            continue
        run_ = await load(engines, c, max(c, a.min_requests), a.tokens, a.codes)
        result["runs"].append(run_)
        print(json.dumps(run_), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
    if cuda:
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["batch_sizes"] = {s: dict(sorted(e.batch_sizes().items())) for s, e in engines.items()}
    result["slot_steps"] = {s: dict(ran) for s, e in engines.items() if (ran := e.slot_steps()) is not None}
    for e in engines.values():
        await e.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--pipeline", choices=PIPELINES, default="qwen3-omni")
    p.add_argument("--sizes", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-dir", default="/tmp/omni-config-only", help="where the configs go")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--min-requests", type=int, default=2, help="requests at least, at any concurrency")
    p.add_argument("--tokens", type=int, default=64, help="thinker tokens a request")
    p.add_argument("--codes", type=int, default=100, help="talker codes a request at most (8 s)")
    p.add_argument("--budget-s", type=float, default=360, help="no concurrency starts after this")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the talker and thinker with cudaGraphs: their decode steps (and a code predictor's) graphed",
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        help="the thinker's and talker's prefillBatchTokens (their default: 2048 on CUDA, 0 elsewhere)",
    )
    a = p.parse_args()
    result = asyncio.run(run(a))
    Path(a.out).write_text(json.dumps(result, indent=2))
    print("\n" + json.dumps({k: v for k, v in result.items() if k != "runs"}))
    print(f"{'c':>3} {'ttft ms':>8} {'ttfp ms':>8} {'rtf':>6} {'req/s':>6} {'audio s':>7} {'gpu %':>6}")
    for r in result["runs"]:
        row = (r["concurrency"], r["ttft_ms"], r["ttfp_ms"], r["rtf"], r["req_per_s"], r["audio_s"])
        print("{:>3} {:>8} {:>8} {:>6} {:>6} {:>7} {:>6}".format(*row, str(r["gpu_utilization"])))


if __name__ == "__main__":
    main()
