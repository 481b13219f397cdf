"""A pipeline's real stage engines driven in one process, fed window by window as the pipeline
feeds them: for measuring the engines without the processes, NATS and connectors around them
(scripts/gpu_bench.py on a machine that has none of those; `omni bench step`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall
from omni_stage.engines.registry import build_engine
from omni_stage.payload import Payload, concat
from omni_stage.segments import EngineOutput


def stage_engine(example: Path, name: str, model: Path, max_batch: int, **args: Any) -> Engine:
    """Stage `name` of the pipeline file `example` on `model`, its engine's arguments with `args`
    over them (its `threads` dropped: a GPU run sets none), batching up to `max_batch` requests."""
    spec = load_pipeline(example).spec.stage(name)
    merged = {k: v for k, v in spec.engine.args.items() if k != "threads"} | args | {"maxBatch": max_batch}
    eng = spec.engine.model_copy(update={"model": str(model), "args": merged})
    return build_engine(spec.model_copy(update={"engine": eng, "max_inflight": max_batch}))


async def windows(
    outputs: AsyncIterator[EngineOutput],
    n: int,
    into: asyncio.Queue[tuple[Payload, bool]],
    first: int | None = None,
) -> None:
    """A producer's outputs as its consumer receives them on a window of `n` units (the first of
    `first`, an edge's `firstWindow`), then the rest as the last."""
    parts: list[Payload] = []
    units = 0
    size = first or n
    async for out in outputs:
        if out.data:
            parts.append(out.data)
        units += out.units
        if units >= size:
            await into.put((concat(parts), False))
            parts, units, size = [], 0, n
    await into.put((concat(parts) if parts else {}, True))


async def calls(
    consumer: Engine,
    producer: str,
    rid: str,
    sampling: Sampling,
    arriving: asyncio.Queue[tuple[Payload, bool]],
) -> AsyncIterator[EngineOutput]:
    """Every output of `consumer` for one request, called once for each window that arrives (and
    on the last, however empty, as a stage calls an engine that needs it)."""
    state = CallState()
    while True:
        payload, last = await arriving.get()
        if payload or last:
            inputs = {producer: payload} if payload else {}
            async for out in consumer.generate(EngineCall(rid, inputs, last, sampling, state)):
                yield out
        if last:
            return
