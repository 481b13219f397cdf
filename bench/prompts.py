"""prompts: a burst of prompts with images at the omni thinkers, and what their building costs
the forwards.

A thinker builds a prompt (the chat template, its tokens, an image's features: the image
processor's resize and patches) before its prefill. That reads no weights, so it runs on the
engine's prompt thread, beside the forwards (engines/base.py, `ComputeEngine._build`); on the
compute thread it would hold up every other request's steps, and on a GPU leave the device
idle meanwhile. This measures it on the real engines (bench.in_process: the example's
thinker, its own compute thread and step batcher, one torch thread as the example gives it):
8 requests at once, each an image (1280x720, each its own) and a question, 8 tokens each
(min_tokens = max_tokens), greedy; and the same request alone, before them.

Ratios: `compute_outside_calls_<model>`, the compute thread's seconds outside the batcher's
calls (the forwards and what a step does around them) over its seconds in all, in the burst
(0: the compute thread does nothing else; a build on it shows here); and
`ttft_c8_vs_c1_<model>`, the burst's median first token over one request's alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, parser, report, rounds, warmed
from bench.in_process import stage_engine
from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import Engine, EngineCall

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"qwen2.5-omni": "tiny-qwen2.5-omni", "qwen3-omni": "tiny-qwen3-omni"}
"""Each model's example (examples/NAME.yaml) and its demo checkpoint."""
BURST = 8
TOKENS = 8
IMAGE = (720, 1280, 3)


def request(image: torch.Tensor) -> dict[str, Any]:
    content = [{"type": "image", "media": "image"}, {"type": "text", "text": "What is in the picture?"}]
    return {"messages": [{"role": "user", "content": content}], "media": {"image": image}}


async def first_token(thinker: Engine, rid: str, image: torch.Tensor, t0: float) -> float:
    """Seconds from `t0` to the request's first token (its last read too: the steps after it
    are part of the burst's load)."""
    sampling = Sampling(max_tokens=TOKENS, min_tokens=TOKENS)
    first = None
    async for _ in thinker.generate(EngineCall(rid, {"request": request(image)}, True, sampling)):
        first = first or time.perf_counter() - t0
    assert first is not None
    return first


async def measure(name: str, checkpoint: Path, bursts: int, warm: bool) -> dict[str, float]:
    # (its torch threads as the example serves it: one, the other core free for the builds)
    thinker = stage_engine(ROOT / "examples" / f"{name}.yaml", "thinker", checkpoint, BURST, threads=1)
    await thinker.start()
    try:
        g = torch.Generator().manual_seed(0)
        images = [torch.randint(0, 256, IMAGE, dtype=torch.uint8, generator=g) for _ in range(BURST)]
        if warm:
            await first_token(thinker, "warm", images[0], time.perf_counter())
        alone = [await first_token(thinker, f"alone-{i}", images[i], time.perf_counter()) for i in range(3)]
        batcher = thinker.batcher  # type: ignore[attr-defined]
        busy, calls = thinker.compute_seconds() or 0.0, sum(batcher.seconds.values())
        firsts: list[float] = []
        for b in range(bursts):
            t0 = time.perf_counter()
            firsts += await asyncio.gather(
                *(first_token(thinker, f"burst-{b}-{i}", images[i], t0) for i in range(BURST))
            )
        busy = (thinker.compute_seconds() or 0.0) - busy
        calls = sum(batcher.seconds.values()) - calls
    finally:
        await thinker.close()
    return {
        "ttft_c1_ms": round(statistics.median(alone) * 1e3, 1),
        f"ttft_c{BURST}_ms": round(statistics.median(firsts) * 1e3, 1),
        "compute_s": round(busy, 3),
        "calls_s": round(calls, 3),
        "compute_outside_calls": round(max(0.0, busy - calls) / busy, 3),
        "ttft_c8_vs_c1": round(statistics.median(firsts) / statistics.median(alone), 2),
    }


async def run(bursts: int, warm: bool) -> dict[str, Any]:
    from bench.procs import demo_models

    with demo_models() as demo:
        models = {
            name: await measure(name, demo / "models" / ck, bursts, warm) for name, ck in MODELS.items()
        }
    return {
        "benchmark": "prompts",
        "machine": machine(),
        "burst": BURST,
        "tokens": TOKENS,
        "models": models,
        "ratios": {
            f"{k}_{name}": m[k]
            for name, m in models.items()
            for k in ("compute_outside_calls", "ttft_c8_vs_c1")
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    result = asyncio.run(run(rounds(5, args), warmed(args)))
    rows = [
        (
            name,
            f"first token alone {m['ttft_c1_ms']} ms, c{BURST} {m[f'ttft_c{BURST}_ms']} ms; "
            f"compute thread outside its calls {m['compute_outside_calls']:.0%}",
        )
        for name, m in result["models"].items()
    ]
    report("prompts", rows, result, args)


if __name__ == "__main__":
    main()
