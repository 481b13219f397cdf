"""Qwen3-Omni at its real sizes on a GPU: first audio packet, real-time factor, requests per
second at concurrency 1, 8 and 16, and GPU memory per stage, as one prepared run of under 10
minutes (docs/benchmarks.md, "GPU").

The machine it is written for has torch and transformers but no network, no NATS and a disk
smaller than the checkpoint (70 GB): so the pipeline's three stages run here in one process,
each its real engine (omni_stage's, built from examples/qwen3-omni.yaml as a stage builds it,
with its own compute thread and step batcher), fed window by window as the pipeline feeds them
(thinker -> talker on 4 tokens, talker -> code2wav on 12 codes), on a config-only checkpoint at
Qwen3-Omni-30B-A3B's sizes with `loadFormat: dummy` (random weights built on the device). The
gateway, NATS and the shared-memory connector are left out: on one node they add about a
millisecond a hop (docs/benchmarks.md, "hop"), and the stages share one Python process here,
where `omni serve` gives each its own (their host work contends for one interpreter here).

Figures as vLLM-Omni defines them: TTFP from a request's start to its first audio chunk; RTF
from its start to its last chunk over the seconds of audio; requests/s completed at a
concurrency. Each request: the same prompt, THINKER_TOKENS tokens (min_tokens = max_tokens,
random weights would end at random), up to TALKER_CODES codes (the talker may draw its end
code sooner), greedy.

Not part of the suite (CI has no GPU). From the repository root, the project importable:
    python scripts/gpu_bench.py OUT.json [--sizes full|tiny] [--device cuda]
`--sizes tiny` runs the same on the demo's dimensions (a check of the script on a CPU).
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

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall
from omni_stage.engines.registry import build_engine
from omni_stage.models.qwen3_omni.checkpoint import FULL_SIZE, TINY, write_config_only
from omni_stage.payload import Payload, concat
from omni_stage.segments import EngineOutput

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen3-omni.yaml"
STAGES = ("thinker", "talker", "code2wav")
THINKER_WINDOW, TALKER_WINDOW = 4, 12  # the example's windows
SAMPLE_RATE = 24000
PROMPT = "Tell me about the sea."


def engine(name: str, model: Path, device: str, max_batch: int) -> Engine:
    """The example's stage `name` on `model`, on `device` in bfloat16 (float32 on a CPU), with
    dummy weights and steps batched up to `max_batch` requests."""
    spec = load_pipeline(EXAMPLE).spec.stage(name)
    args = {k: v for k, v in spec.engine.args.items() if k != "threads"}
    dtype = "bfloat16" if device == "cuda" else "float32"
    args |= {"device": device, "dtype": dtype, "loadFormat": "dummy", "maxBatch": max_batch}
    eng = spec.engine.model_copy(update={"model": str(model), "args": args})
    return build_engine(spec.model_copy(update={"engine": eng, "max_inflight": max_batch}))


async def windows(
    outputs: AsyncIterator[EngineOutput], n: int, into: asyncio.Queue[tuple[Payload, bool]]
) -> None:
    """A producer's outputs as its consumer receives them on a window of `n` units."""
    parts: list[Payload] = []
    units = 0
    async for out in outputs:
        if out.data:
            parts.append(out.data)
        units += out.units
        if units >= n:
            await into.put((concat(parts), False))
            parts, units = [], 0
    await into.put((concat(parts) if parts else {}, True))


async def calls(
    consumer: Engine,
    producer: str,
    rid: str,
    sampling: Sampling,
    arriving: asyncio.Queue[tuple[Payload, bool]],
) -> AsyncIterator[EngineOutput]:
    """Every output of `consumer` for one request, called once per window that arrives."""
    state = CallState()
    while True:
        payload, last = await arriving.get()
        if payload or last:
            inputs = {producer: payload} if payload else {}
            async for out in consumer.generate(EngineCall(rid, inputs, last, sampling, state)):
                yield out
        if last:
            return


async def one(engines: dict[str, Engine], rid: str, tokens: int, codes: int) -> dict[str, float]:
    """One request through the three stages; its times from its start."""
    thinker, talker, code2wav = (engines[s] for s in STAGES)
    t0 = time.perf_counter()
    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}], "media": {}}
    thought: asyncio.Queue[tuple[Payload, bool]] = asyncio.Queue()
    spoken: asyncio.Queue[tuple[Payload, bool]] = asyncio.Queue()
    times: dict[str, float] = {}

    async def think() -> AsyncIterator[EngineOutput]:
        sampling = Sampling(max_tokens=tokens, min_tokens=tokens)
        async for out in thinker.generate(EngineCall(rid, {"request": request}, True, sampling)):
            times.setdefault("ttft", time.perf_counter() - t0)
            yield out

    samples = 0
    speech = calls(talker, "thinker", rid, Sampling(max_tokens=codes, voice="Ethan"), thought)
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(windows(think(), THINKER_WINDOW, thought))
        tasks.create_task(windows(speech, TALKER_WINDOW, spoken))
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
    sizes = (
        FULL_SIZE if a.sizes == "full" else dataclasses.replace(TINY, thinker_vocab=FULL_SIZE.thinker_vocab)
    )
    model = write_config_only(Path(a.model_dir), sizes)
    cuda = a.device == "cuda"
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "sizes": a.sizes,
        "torch": torch.__version__,
        "thinker_tokens": a.tokens,
        "talker_codes": a.codes,
        "memory_gib": {},
        "load_s": {},
        "runs": [],
    }
    engines: dict[str, Engine] = {}
    for name in STAGES:
        before = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        engines[name] = engine(name, model, a.device, max(a.concurrency))
        await engines[name].start()
        result["load_s"][name] = round(time.perf_counter() - t0, 1)
        if cuda:
            result["memory_gib"][name] = round((torch.cuda.memory_allocated() - before) / 2**30, 2)
        print(f"{name} loaded in {result['load_s'][name]} s {result['memory_gib'].get(name, '')}", flush=True)
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
    for e in engines.values():
        await e.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--sizes", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-dir", default="/tmp/qwen3-omni-full-size")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--min-requests", type=int, default=2, help="requests at least, at any concurrency")
    p.add_argument("--tokens", type=int, default=64, help="thinker tokens a request")
    p.add_argument("--codes", type=int, default=100, help="talker codes a request at most (8 s)")
    p.add_argument("--budget-s", type=float, default=360, help="no concurrency starts after this")
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
