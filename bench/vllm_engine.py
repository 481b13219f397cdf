"""vLLM engine adapter: tokens/s through omni's VllmEngine vs raw AsyncLLM, and concurrency.

Both paths use the same AsyncLLM instance, model (the tiny demo thinker, on vLLM's CPU build
here), prompts and sampling (greedy, 128 tokens, no early stop), alternating A/B over several
rounds after a warm-up; throughput is total generated tokens / wall time of a round.

- adapter_vs_raw: 8 concurrent requests through VllmEngine.generate (prompt building via the
  chat template, delta outputs turned into EngineOutputs) ÷ the same through AsyncLLM.generate
  with pre-tokenized prompts. Goal >= 0.9.
- inflight_8_vs_1: 16 requests through the adapter 8 at a time ÷ one at a time (what a stage's
  maxInflight does). Continuous batching should make 8 at a time much faster.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

from bench.common import machine, median, parser, report
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import EngineKind, EngineSpec, OutputKind, StageSpec
from omni_stage.engines.base import EngineCall
from omni_stage.engines.prompts import prompt_token_ids
from omni_stage.engines.vllm.engine import VllmEngine

TOKENS = 128
ROUNDS = 5
_ids = itertools.count()


def messages(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Tell me about stage number {i}."}]}


async def adapter_round(engine: VllmEngine, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            call = EngineCall(f"a{next(_ids)}", {"request": messages(i)}, True, Sampling(max_tokens=TOKENS))
            async for out in engine.generate(call):
                tokens += out.units

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return tokens / (time.perf_counter() - t)


async def raw_round(engine: VllmEngine, n: int) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    prompts = [{"prompt_token_ids": prompt_token_ids(engine.tokenizer, messages(i))} for i in range(n)]
    tokens = 0

    async def one(p: dict[str, Any]) -> None:
        nonlocal tokens
        async for out in engine.llm.generate(p, sp, request_id=f"r{next(_ids)}"):
            tokens += len(out.outputs[0].token_ids)

    t = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return tokens / (time.perf_counter() - t)


async def run(model: str) -> dict[str, Any]:
    stage = StageSpec(
        name="thinker",
        engine=EngineSpec(
            kind=EngineKind.VLLM, model=model, args={"max_model_len": 1024, "dtype": "float32"}
        ),
        inputs=[{"from": "request"}],  # type: ignore[list-item]
        final_output=OutputKind.TEXT,
    )
    engine = VllmEngine(stage)
    await engine.start()
    try:
        await adapter_round(engine, 8, 8)  # warm-up
        await raw_round(engine, 8)
        raw, adapter, one_at_a_time, eight_at_a_time = [], [], [], []
        for _ in range(ROUNDS):
            raw.append(await raw_round(engine, 8))
            adapter.append(await adapter_round(engine, 8, 8))
        for _ in range(3):
            one_at_a_time.append(await adapter_round(engine, 16, 1))
            eight_at_a_time.append(await adapter_round(engine, 16, 8))
    finally:
        await engine.close()
    return {
        "benchmark": "vllm_engine",
        "machine": machine(),
        "tokens_per_request": TOKENS,
        "raw_tokens_per_s": round(median(raw), 1),
        "adapter_tokens_per_s": round(median(adapter), 1),
        "inflight_1_tokens_per_s": round(median(one_at_a_time), 1),
        "inflight_8_tokens_per_s": round(median(eight_at_a_time), 1),
        "ratios": {
            "adapter_vs_raw": round(median(adapter) / median(raw), 3),
            "inflight_8_vs_1": round(median(eight_at_a_time) / median(one_at_a_time), 2),
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="models/tiny-thinker", help="built by `omni models init-demo models`")
    a = ap.parse_args(argv)
    if not Path(a.model).is_dir():
        raise SystemExit(f"{a.model} not found: run `omni models init-demo models` first")
    r = asyncio.run(run(a.model))
    rows = [
        ("raw AsyncLLM, 8 concurrent", f"{r['raw_tokens_per_s']} tok/s"),
        ("adapter, 8 concurrent", f"{r['adapter_tokens_per_s']} tok/s"),
        ("adapter / raw (goal >= 0.9)", str(r["ratios"]["adapter_vs_raw"])),
        ("adapter, 1 at a time", f"{r['inflight_1_tokens_per_s']} tok/s"),
        ("adapter, 8 at a time", f"{r['inflight_8_tokens_per_s']} tok/s"),
        ("8 at a time / 1 at a time", str(r["ratios"]["inflight_8_vs_1"])),
    ]
    report("vllm_engine", rows, r, a)


if __name__ == "__main__":
    main()
