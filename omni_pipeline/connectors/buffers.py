"""Warm buffers: memory that is reused instead of allocated per payload.

A large fresh allocation page-faults on first touch, which costs several times the copy
itself; connectors keep the buffers they used and hand them out again. Sizes come in classes
(steps of at most 1/8), so a pool serves payloads whose size varies a little.
"""

from __future__ import annotations

import threading
import weakref
from typing import Final

import numpy as np

MIN_CAPACITY: Final = 64 << 10


def capacity_class(size: int) -> int:
    """The capacity a buffer for `size` bytes gets: rounded up by at most 1/8."""
    size = max(size, MIN_CAPACITY)
    step = 1 << max(12, size.bit_length() - 4)
    return -(-size // step) * step


def capacities_for(size: int) -> range:
    """The capacities a buffer may have to serve `size` bytes: enough, and not far too large.
    Worked out once a payload (`capacity in` it is one comparison in C): a pool holds a hundred
    buffers or segments under load, and a class worked out again for each was a tenth of a
    stage's CPU on the shared-memory path."""
    return range(size, 2 * capacity_class(size) + 1)


class BufferPool:
    """Process-local uint8 buffers, taken and given back, or leased to a decoded payload and
    given back when the payload's last tensor is freed. At most `idle_bytes` stay idle."""

    def __init__(self, idle_bytes: int) -> None:
        self.idle_bytes = idle_bytes
        self._idle: list[np.ndarray] = []  # least recently given back first
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least `size` bytes, the caller's until it gives it back."""
        fitting = capacities_for(size)
        with self._lock:
            best = min(
                (i for i, b in enumerate(self._idle) if b.nbytes in fitting),
                key=lambda i: self._idle[i].nbytes,
                default=None,
            )
            if best is not None:
                return self._idle.pop(best)
        return np.empty(capacity_class(size), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._idle.append(buf)
            total = sum(b.nbytes for b in self._idle)
            while total > self.idle_bytes:
                total -= self._idle.pop(0).nbytes

    def lease(self, size: int) -> np.ndarray:
        """A view of `size` bytes on a taken buffer, given back once the view and every view
        derived from it (decoded tensors) are gone."""
        buf = self.take(size)
        view = buf[:size]
        weakref.finalize(view, self.give, buf)
        return view

    def idle(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle)
