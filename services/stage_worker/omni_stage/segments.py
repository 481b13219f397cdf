"""Producer-side segmentation: engine outputs are flushed as numbered segments (seed 000, §6).

A segment is flushed when it holds `max_units` units (the first one: `first_units`, where a
consumer's first window or a client's first audio waits on fewer, counted after a stream's
context: `payload.lead_units`), when `flush_interval_s` has passed since the last flush, and at
the end of the request (`is_last`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_pipeline.control import TokenLogprob, ToolCall
from omni_stage.payload import Payload, concat, lead_units


@dataclass(slots=True)
class EngineOutput:
    """One step's output of an engine for one request."""

    units: int = 0
    text: str = ""
    data: Payload = field(default_factory=dict)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """The step's tokens' log probabilities, where the request asked for them."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The function calls the reply ended with (on its last output)."""


@dataclass(frozen=True)
class Segment:
    sequence: int
    units: int
    text: str
    parts: tuple[Payload, ...]
    """The engine's outputs' payloads, joined into `data` where that is first read (the runner
    reads it off the event loop: joining copies every tensor)."""
    is_last: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)

    @functools.cached_property
    def data(self) -> Payload:
        return concat(list(self.parts)) if self.parts else {}


class Segmenter:
    """Accumulates one request's outputs and cuts them into segments."""

    def __init__(
        self,
        max_units: int,
        flush_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        first_units: int | None = None,
    ) -> None:
        self.max_units = max_units
        self._due_units = max_units if first_units is None else min(first_units, max_units)
        """Units that flush the next segment: `first_units` for the first, then `max_units`."""
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush = clock()
        self._parts: list[Payload] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._tool_calls: list[ToolCall] = []
        self._units = 0
        self._finish: str | None = None
        self.sequence = 0
        self.total_units = 0

    def add(self, out: EngineOutput) -> Segment | None:
        if not self.sequence and not self._parts and out.data:  # the first: after any context
            self._due_units += lead_units(out.data)
        if out.data:
            self._parts.append(out.data)
        if out.text:
            self._text.append(out.text)
        self._logprobs += out.logprobs
        self._tool_calls += out.tool_calls
        self._units += out.units
        self._finish = out.finish_reason or self._finish
        due = self._units >= self._due_units or self._clock() - self._last_flush >= self.flush_interval_s
        return self._flush(False) if due and (self._units or self._text) else None

    def finish(self) -> Segment:
        return self._flush(True)

    def _flush(self, is_last: bool) -> Segment:
        seg = Segment(
            sequence=self.sequence,
            units=self._units,
            text="".join(self._text),
            parts=tuple(self._parts),
            is_last=is_last,
            finish_reason=self._finish if is_last else None,
            logprobs=self._logprobs,
            tool_calls=self._tool_calls,
        )
        self.sequence += 1
        self._due_units = self.max_units
        self.total_units += self._units
        self._parts, self._text, self._logprobs, self._tool_calls, self._units = [], [], [], [], 0
        self._last_flush = self._clock()
        return seg
