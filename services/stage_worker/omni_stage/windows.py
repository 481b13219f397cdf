"""Edge windows: when a producer's output is handed to a consumer (seed 000, section 10).

window -1: one chunk, when the producer's last segment arrives (full trigger).
window  N: a chunk every N units, then the remainder with `is_last`; exactly one chunk of a
           request's stream carries `is_last`, even when the remainder is empty. With a first
           window F (`firstWindow`), the first chunk is F units, the rest N each.

A stream that opens with context (`payload.lead_units`) has its first window counted after
it: the context comes with the first F units the consumer voices, not in their stead.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_pipeline.spec import FULL_WINDOW
from omni_stage.payload import Payload, concat, lead_units, split


def is_read(window: int, units: int) -> bool:
    """Whether a consumer reads a chunk of `units` on an edge of this window (and so returns
    its credit): on a windowed edge, a last chunk of no units only marks the end."""
    return units > 0 or window == FULL_WINDOW


@dataclass(frozen=True, slots=True)
class Chunk:
    payload: Payload
    units: int
    is_last: bool


class WindowState:
    """Buffers one request's output for one out-edge and cuts it into window-sized chunks."""

    def __init__(self, window: int, first: int | None = None) -> None:
        self.window = window
        self._next = window if first is None else first
        """The size of the next chunk: the first window, then the window."""
        self._parts: list[Payload] = []
        self._units = 0
        self._started = False
        self._done = False

    def push(self, payload: Payload, units: int, is_last: bool) -> list[Chunk]:
        if self._done:
            raise RuntimeError("segment after the last one")
        if not self._started:  # the first chunk counts its F units after the stream's context
            self._started = True
            self._next += lead_units(payload)
        if units or payload:
            self._parts.append(payload)
            self._units += units
        out: list[Chunk] = []
        if self.window != FULL_WINDOW:
            while self._units >= self._next and (self._units > self._next or not is_last):
                size = self._next
                head, rest = split(concat(self._parts), size)
                self._parts, self._units, self._next = [rest], self._units - size, self.window
                out.append(Chunk(head, size, False))
        if is_last:
            self._done = True
            # A chunk no consumer reads (the end marker) carries no payload.
            read = is_read(self.window, self._units)
            out.append(Chunk(concat(self._parts) if self._parts and read else {}, self._units, True))
            self._parts, self._units = [], 0
        return out
