"""Batched compute for the requests of one replica: what they submit while the compute thread
is busy is run, next, as one call per shape.

A replica serves up to `maxInflight` requests at once, each in its own task, and has one
compute thread. Each task submits its next piece of work (a code2wav chunk, say) with a key
saying what it can be stacked with; when the thread comes free, the batcher takes the oldest
waiting piece and every other waiting piece of the same key (up to `max_batch`) and runs them
as one batched call; a piece a request's first output waits on (`first`) goes before older
ones, so a newcomer's first audio does not queue behind everyone's later chunks (those still
run whenever no first piece waits; a replica admits `maxInflight` requests, so newcomers come
only as others finish). Nothing waits for a batch to fill: under light load a piece runs alone
at once; under load the pieces that queued behind a running call go together. A request
cancelled while waiting is dropped from its batch; a batch that fails is run again piece by
piece, so only the piece that fails fails its request, never the batch the replica.

Pieces carry their request's priority (vLLM's: the lower value first; `STEP_PRIORITY`, set in
each request's task): the next call is the key of the best piece waiting, and a call that
cannot take every piece of its key takes the best first. A live user's step so runs before
a batch line's, and beside as few of them as the call's room allows. With every priority
equal (0) the order is the one above.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

I = TypeVar("I")  # noqa: E741 (the item type)
O = TypeVar("O")  # noqa: E741


STEP_PRIORITY: Final[ContextVar[int]] = ContextVar("omni_step_priority", default=0)
"""The priority of the request whose task submits (the stage's runner sets it per request)."""


@dataclass(slots=True, eq=False)  # compared by identity: an item may hold tensors
class _Waiting(Generic[I, O]):
    key: Hashable
    item: I
    done: asyncio.Future[O]
    first: bool
    priority: int
    arrival: int

    def rank(self) -> tuple[int, bool, int]:
        """Which piece's key runs next: the best priority, then a first output's, then the oldest."""
        return self.priority, not self.first, self.arrival


class StepBatcher(Generic[I, O]):
    def __init__(
        self,
        run: Callable[[list[I]], list[O]],
        executor: Executor,
        max_batch: int,
        max_of: Callable[[Hashable], int] | None = None,
    ) -> None:
        """`max_of(key)`: the most pieces of that key in one call, where less than `max_batch`
        (a long call holds up a newcomer's first piece, which can only go after it)."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.run = run
        self.executor = executor
        self.max_batch = max_batch
        self.max_of = max_of
        self._waiting: list[_Waiting[I, O]] = []
        self._arrivals = itertools.count()
        self._busy = False
        self._running = 0
        """Pieces in the call on the compute thread now."""
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size have run (for tests and metrics)."""
        self.seconds: Counter[tuple[Hashable, int]] = Counter()
        """Seconds the calls that answered their whole batch took, by key and batch size (`omni
        bench step` sets a kind of step's time against its forwards')."""
        self.calls: Counter[tuple[Hashable, int]] = Counter()
        """Those calls, by key and batch size."""

    @property
    def running(self) -> int:
        """The pieces in the call on the compute thread now (0 between calls)."""
        return self._running

    def occupancy(self) -> float:
        """How busy the replica's compute is: the pieces running and waiting, over the most one
        call takes (0 idle; 1 or more: a whole call's worth is queued)."""
        return (self._running + len(self._waiting)) / self.max_batch

    def submit(self, key: Hashable, item: I, first: bool = False) -> asyncio.Future[O]:
        """Queue `item` now; the future is its result. Cancelling it drops the item. `first`:
        the request's first output waits on it, so its batch runs before older ones."""
        done: asyncio.Future[O] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(key, item, done, first, STEP_PRIORITY.get(), next(self._arrivals)))
        self._next()
        return done

    def _next(self) -> None:
        self._waiting = [w for w in self._waiting if not w.done.cancelled()]
        if self._busy or not self._waiting:
            return
        key = min(self._waiting, key=_Waiting.rank).key
        most = self.max_batch if self.max_of is None else max(1, min(self.max_batch, self.max_of(key)))
        batch = sorted((w for w in self._waiting if w.key == key), key=lambda w: (w.priority, w.arrival))[
            :most
        ]
        self._waiting = [w for w in self._waiting if w not in batch]
        self._busy, self._running = True, len(batch)
        self.batch_sizes[len(batch)] += 1
        work = asyncio.get_running_loop().run_in_executor(
            self.executor, self._run_batch, key, [w.item for w in batch]
        )
        work.add_done_callback(lambda f: self._finished(batch, f))

    def _run_batch(self, key: Hashable, items: list[I]) -> list[O | BaseException]:
        """On the compute thread: the batch, or, if it fails, each item alone."""
        t0 = time.perf_counter()
        try:
            out = self.run(items)
            self.seconds[key, len(items)] += time.perf_counter() - t0
            self.calls[key, len(items)] += 1
            if len(out) != len(items):
                raise RuntimeError(f"a batch of {len(items)} gave {len(out)} results")
            return list(out)
        except Exception:
            if len(items) == 1:
                raise
        results: list[O | BaseException] = []
        for item in items:
            try:
                results.append(self.run([item])[0])
            except Exception as exc:
                results.append(exc)
        return results

    def _finished(self, batch: list[_Waiting[I, O]], work: asyncio.Future[list[O | BaseException]]) -> None:
        self._running = 0
        error = None if work.cancelled() else work.exception()
        for i, w in enumerate(batch):
            if w.done.done():
                continue  # cancelled meanwhile: its result is dropped
            if work.cancelled():
                w.done.cancel()
            elif error is not None:
                w.done.set_exception(error)
            else:
                r = work.result()[i]
                if isinstance(r, BaseException):
                    w.done.set_exception(r)
                else:
                    w.done.set_result(r)
        # Not at once: first let the requests just answered run up to their next submit (their
        # wake-ups were queued above, before this), so that their next pieces go together.
        asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._busy = False
        self._next()
