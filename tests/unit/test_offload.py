"""OffLoop, the connectors' calls off the event loop: what a call raises holds nothing of its
callers once it has been handled."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

from omni_pipeline.connectors.offload import OffLoop


class Pinned:
    """Stands for what a caller's frame holds: a window's inputs, views on shared memory."""


def backend_says_no() -> None:
    raise ValueError("the backend said no")


async def caller(off: OffLoop, refs: list[weakref.ref[Pinned]]) -> None:
    pinned = Pinned()
    refs.append(weakref.ref(pinned))
    await off.call(backend_says_no)


def test_an_error_from_a_call_lets_go_of_its_callers_frames_at_once() -> None:
    """Without the cyclic collector (a process that is idle may not run it for a long time):
    freed by reference counting alone, as soon as the error has been handled."""

    async def main() -> weakref.ref[Pinned]:
        off = OffLoop("test", {})
        refs: list[weakref.ref[Pinned]] = []
        with contextlib.suppress(ValueError):
            await caller(off, refs)
        off.close()
        return refs[0]

    gc.disable()
    try:
        ref = asyncio.run(main())
        assert ref() is None, "the caller's locals are still held: a reference cycle keeps them"
    finally:
        gc.enable()
