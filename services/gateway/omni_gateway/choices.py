"""`n` replies to one request (OpenAI's `n`), as `n` requests side by side: vLLM's own parallel
sampling is `n` child requests too, child `i` seeded with the request's seed plus `i` (unseeded
children sample independently)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

import msgspec

from omni_gateway.events import Event, OfChoice
from omni_gateway.inflight import EVENT_QUEUE
from omni_gateway.request import Prepared

Run = Callable[[str, Prepared], AsyncGenerator[Event, None]]
"""Runs one request by id (Pipeline.run, with the caller's options)."""


def child(req: Prepared, i: int) -> Prepared:
    """Choice `i` of `req`: seeded with its seed plus `i`, where it has one."""
    seed = req.sampling.seed
    return (
        req if seed is None else replace(req, sampling=msgspec.structs.replace(req.sampling, seed=seed + i))
    )


async def run_choices(run: Run, rid: str, n: int, req: Prepared) -> AsyncIterator[OfChoice]:
    """The `n` children's events, interleaved as they come. Closing the iterator aborts them
    all; one failing fails the whole."""
    events: asyncio.Queue[tuple[int, Event | Exception | None]] = asyncio.Queue(EVENT_QUEUE)

    async def one(i: int) -> None:
        events_of = run(f"{rid}.{i}", child(req, i))
        try:
            async for ev in events_of:
                await events.put((i, ev))
            await events.put((i, None))
        except Exception as exc:
            await events.put((i, exc))
        finally:
            await events_of.aclose()  # aborts it, if it had not ended

    children = [asyncio.get_running_loop().create_task(one(i), name=f"choice-{rid}.{i}") for i in range(n)]
    try:
        running = n
        while running:
            i, ev = await events.get()
            if ev is None:
                running -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield OfChoice(i, ev)
    finally:
        for task in children:
            task.cancel()
        await asyncio.gather(*children, return_exceptions=True)
