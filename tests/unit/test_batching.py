"""StepBatcher: pieces submitted while the compute thread is busy run next as one call per
key; a failing piece fails only its own request; a cancelled one leaves its batch."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_stage.engines.batching import STEP_PRIORITY, StepBatcher


class Doubler:
    """Doubles numbers in batches; refuses 13, and holds its first call until let go."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.go = threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.go.wait(10)
        self.calls.append(items)
        if 13 in items:
            raise ValueError("13")
        return [2 * x for x in items]


def test_pieces_that_wait_run_together_by_key_and_a_bad_one_fails_alone() -> None:
    async def go() -> None:
        run = Doubler()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=3)
        first = b.submit("a", 1)  # runs at once, alone, held by `go`
        waiting = [b.submit(k, x) for k, x in [("a", 2), ("b", 5), ("a", 13), ("a", 4), ("a", 6)]]
        run.go.set()
        assert await first == 2
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert results[0] == 4 and results[2].args == ("13",) and results[3] == 8  # type: ignore[union-attr]
        assert results[1] == 10 and results[4] == 12
        # [1]; the oldest key's three ([2, 13, 4]: failed, so again one by one); then what was
        # left, oldest first: b's [5], a's [6].
        assert run.calls == [[1], [2, 13, 4], [2], [13], [4], [5], [6]]
        assert b.batch_sizes == {1: 3, 3: 1}
        # Timed by key and size: the calls that answered their batch whole (not the failed
        # batch, nor its pieces run again alone).
        assert b.calls == {("a", 1): 2, ("b", 1): 1}
        assert b.seconds.keys() == b.calls.keys() and all(s > 0 for s in b.seconds.values())

    asyncio.run(go())


def test_a_first_piece_runs_before_older_ones_with_its_key() -> None:
    """A piece that a request's first output waits on goes before pieces queued earlier: its
    key's batch runs next (with the older pieces of that key), then the rest, oldest first."""

    async def go() -> None:
        run = Doubler()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=8)
        running = b.submit("later", 1)
        waiting = [b.submit("later", 2), b.submit("first", 3), b.submit("first", 4, first=True)]
        run.go.set()
        assert await running == 2
        assert await asyncio.gather(*waiting) == [4, 6, 8]
        assert run.calls == [[1], [3, 4], [2]]

    asyncio.run(go())


def test_a_better_priority_runs_first_and_fills_a_call_first() -> None:
    """Pieces submitted from a request's task carry its priority (STEP_PRIORITY): the best
    piece's key runs next, before an older key and before a first output of a worse priority,
    and a call with room for fewer than its key's pieces takes the best ones first."""

    async def go() -> None:
        run = Doubler()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=2)

        running = b.submit("decode", 1)
        waiting = []
        for key, x, priority, first in [
            ("decode", 2, 1, False),  # a batch line's step
            ("prefill", 3, 1, True),  # a batch line's first output
            ("decode", 4, 0, False),  # a live user's step
            ("decode", 5, 1, False),
            ("decode", 6, 0, False),
        ]:
            STEP_PRIORITY.set(priority)  # as a stage's request task sets it for its own steps
            waiting.append(b.submit(key, x, first))
        run.go.set()
        assert await running == 2
        assert await asyncio.gather(*waiting) == [4, 6, 8, 10, 12]
        # The live steps [4, 6] first (the call's room is 2); then the first output; then the rest.
        assert run.calls == [[1], [4, 6], [3], [2, 5]]

    asyncio.run(go())


def test_a_key_may_run_fewer_at_once_than_the_others() -> None:
    """`max_of`: a key's pieces go at most that many a call (the rest next, oldest first);
    other keys' still up to max_batch."""

    async def go() -> None:
        run = Doubler()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=8, max_of=lambda key: 2 if key == "few" else 8)
        running = b.submit("many", 1)
        waiting = [b.submit("few", x) for x in (2, 3, 4)] + [b.submit("many", x) for x in (5, 6, 7)]
        run.go.set()
        assert await running == 2
        assert await asyncio.gather(*waiting) == [4, 6, 8, 10, 12, 14]
        assert run.calls == [[1], [2, 3], [4], [5, 6, 7]]

    asyncio.run(go())


def test_a_cancelled_piece_leaves_its_batch() -> None:
    async def go() -> None:
        run = Doubler()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=8)
        first = b.submit("a", 1)
        gone = b.submit("a", 2)
        kept = b.submit("a", 3)
        gone.cancel()
        run.go.set()
        assert await first == 2 and await kept == 6
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert run.calls == [[1], [3]]

    asyncio.run(go())


def test_requests_answered_together_step_again_together() -> None:
    """Three requests of four steps each: once their steps have met in one batch, every
    request's next step is queued before the next batch starts, so they stay together (the
    first request's first step ran alone, so it is one step ahead of the others)."""

    async def go() -> None:
        run = Doubler()
        run.go.set()
        b = StepBatcher(run, ThreadPoolExecutor(1), max_batch=8)

        async def request(r: int) -> None:
            for step in range(4):
                assert await b.submit("a", 100 * r + step) == 2 * (100 * r + step)

        await asyncio.gather(*(request(r) for r in (1, 2, 3)))
        assert run.calls == [[100], [200, 300, 101], [201, 301, 102], [202, 302, 103], [203, 303]]

    asyncio.run(go())
