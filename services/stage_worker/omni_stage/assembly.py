"""Consumer-side input assembly: turns arriving chunks into engine triggers, in order.

Chunks of one edge are put back in `sequence` order. A chunk on a windowed edge (N > 0)
triggers the engine on its own. Chunks on full-window edges (-1), and the client request
itself, are held and delivered together in the last trigger, once every edge has ended, so a
fan-in of full windows triggers exactly once. Exactly one trigger carries `is_last`; it may
carry no inputs at all (the request ended with an empty remainder); then only an engine that
`needs_last_call` runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from omni_pipeline.spec import FULL_WINDOW
from omni_stage.windows import is_read

MAX_REORDER: Final = 1024
"""Out-of-order chunks one edge may hold before the request is failed (a lost message)."""

H = TypeVar("H")


class AssemblyError(RuntimeError):
    """The chunk stream of a request is broken (duplicate, after the end, too far out of order)."""


@dataclass(slots=True)
class Trigger(Generic[H]):
    """One engine call: the inputs per producer (payload handles), and whether it is the last."""

    inputs: dict[str, H]
    units: int
    is_last: bool


@dataclass(slots=True)
class _Edge(Generic[H]):
    window: int
    next_seq: int = 0
    ended: bool = False
    held: list[tuple[H, int]] = field(default_factory=list)
    pending: dict[int, tuple[H, int, bool]] = field(default_factory=dict)


class InputAssembler(Generic[H]):
    """One request's inputs at one stage, from the producers its route includes."""

    def __init__(self, windows: dict[str, int]) -> None:
        if not windows:
            raise ValueError("a stage needs at least one input edge")
        self._edges: dict[str, _Edge[H]] = {name: _Edge(w) for name, w in windows.items()}
        self.done = False

    def add(
        self, producer: str, sequence: int, item: H | None, units: int, is_last: bool
    ) -> list[Trigger[H]]:
        edge = self._edges.get(producer)
        if edge is None:
            raise AssemblyError(f"unexpected input from '{producer}'")
        if edge.ended or sequence < edge.next_seq or sequence in edge.pending:
            raise AssemblyError(f"duplicate or late chunk {sequence} from '{producer}'")
        if len(edge.pending) >= MAX_REORDER:
            raise AssemblyError(f"chunks from '{producer}' too far out of order (lost message?)")
        edge.pending[sequence] = (item, units, is_last)  # type: ignore[assignment]
        out: list[Trigger[H]] = []
        while edge.next_seq in edge.pending:
            it, n, last = edge.pending.pop(edge.next_seq)
            edge.next_seq += 1
            if it is not None and is_read(edge.window, n):
                if edge.window == FULL_WINDOW:
                    edge.held.append((it, n))
                else:
                    out.append(Trigger({producer: it}, n, False))
            if last:
                edge.ended = True
                break
        if all(e.ended for e in self._edges.values()) and not self.done:
            self.done = True
            held = {p: e.held for p, e in self._edges.items() if e.held}
            if any(len(v) > 1 for v in held.values()):
                raise AssemblyError("a full-window edge sent more than one chunk")
            if held:
                out.append(
                    Trigger({p: v[0][0] for p, v in held.items()}, sum(v[0][1] for v in held.values()), True)
                )
            elif out:
                out[-1].is_last = True
            else:
                out.append(Trigger({}, 0, True))
        return out
