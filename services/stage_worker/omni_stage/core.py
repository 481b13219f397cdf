"""A replica's scheduling state, plain and synchronous: admit, release, abort, load.

No NATS, sockets or event loop here (the process in omni_stage.proc owns those), so tests
drive it directly. It decides which requests run (at most `max_inflight`), which wait (at
most `max_queued`) and which are refused, and it remembers recently aborted requests so their
late messages are dropped and their data freed instead of starting them again. Waiting
requests start by priority (vLLM's: the lower value first; a batch's lines come after live
users' requests), then first come first served.

A running request that waits for its consumer (no credit left on an out-edge) is *paused*:
it gives its slot to the next queued request and takes one back when it goes on, so two
stages that admitted the same requests in different orders cannot wait on each other for
ever. A paused request keeps its engine state, so the bound on what a replica holds is
`max_inflight + max_queued` requests, running, paused and queued together.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from omni_stage.state import Phase, ReplicaState

ABORTED_MEMORY: Final = 10_000
"""How many aborted request ids a replica remembers (to drop their late messages)."""


class Admission(enum.Enum):
    RUN = "run"
    QUEUE = "queue"
    REJECT_FULL = "full"
    REJECT_DRAINING = "draining"
    REJECT_SLEEPING = "sleeping"


@dataclass(frozen=True, slots=True)
class Load:
    queued: int
    inflight: int
    """Running and paused: both hold a request's engine state."""
    capacity: int
    max_queued: int
    paused: int = 0


class StageCore:
    def __init__(self, max_inflight: int, max_queued: int, state: ReplicaState | None = None) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.state = state if state is not None else ReplicaState()
        """The replica's phase: draining or asleep, it admits nothing (what it holds runs on)."""
        self.running: set[str] = set()
        self.paused: set[str] = set()
        self.waiting: dict[str, int] = {}
        """Queued requests and their priorities."""
        self._queue: list[tuple[int, int, str]] = []
        """(priority, arrival, id) of the waiting requests, as a heap; an aborted one's entry
        stays until it comes up (it is no longer in `waiting`)."""
        self._arrivals = itertools.count()
        self._aborted: OrderedDict[str, None] = OrderedDict()

    def known(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.paused or request_id in self.waiting

    def is_aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def admit(self, request_id: str, priority: int = 0) -> Admission:
        """A new request: run it now, queue it, or refuse it (and then it counts as aborted)."""
        assert not self.known(request_id), request_id
        if self.state.phase in (Phase.DRAINING, Phase.DEAD):
            self._forget(request_id)
            return Admission.REJECT_DRAINING
        if self.state.phase is Phase.SLEEPING:
            self._forget(request_id)
            return Admission.REJECT_SLEEPING
        held = len(self.running) + len(self.paused) + len(self.waiting)
        if held >= self.max_inflight + self.max_queued:
            self._forget(request_id)
            return Admission.REJECT_FULL
        if len(self.running) < self.max_inflight and not self.waiting:
            self.running.add(request_id)
            return Admission.RUN
        if len(self.waiting) < self.max_queued:
            self.waiting[request_id] = priority
            heapq.heappush(self._queue, (priority, next(self._arrivals), request_id))
            return Admission.QUEUE
        self._forget(request_id)
        return Admission.REJECT_FULL

    def release(self, request_id: str) -> list[str]:
        """A running (or paused) request ended; returns the queued requests that start now."""
        self.running.discard(request_id)
        self.paused.discard(request_id)
        return self._start_waiting()

    def pause(self, request_id: str) -> list[str]:
        """A running request waits on its consumer; returns the queued requests that start now."""
        if request_id in self.running:
            self.running.remove(request_id)
            self.paused.add(request_id)
        return self._start_waiting()

    def resume(self, request_id: str) -> None:
        """A paused request goes on, even past `max_inflight` for a while: it was admitted to run,
        and holding it back could make it wait on a request that waits on it."""
        if request_id in self.paused:
            self.paused.remove(request_id)
            self.running.add(request_id)

    def _start_waiting(self) -> list[str]:
        started = []
        while self.waiting and len(self.running) < self.max_inflight:
            _, _, rid = heapq.heappop(self._queue)
            if self.waiting.pop(rid, None) is None:
                continue  # aborted while it waited
            self.running.add(rid)
            started.append(rid)
        return started

    def abort(self, request_id: str) -> bool:
        """Mark aborted; returns True if it was running or paused (the caller cancels its task)."""
        self._forget(request_id)
        self.waiting.pop(request_id, None)  # its heap entry is skipped when it comes up
        if not self.waiting:
            self._queue.clear()
        return request_id in self.running or request_id in self.paused

    def _forget(self, request_id: str) -> None:
        self._aborted[request_id] = None
        self._aborted.move_to_end(request_id)
        while len(self._aborted) > ABORTED_MEMORY:
            self._aborted.popitem(last=False)

    def has_work(self) -> bool:
        return bool(self.running or self.paused or self.waiting)

    def load(self) -> Load:
        inflight = len(self.running) + len(self.paused)
        return Load(len(self.waiting), inflight, self.max_inflight, self.max_queued, len(self.paused))
