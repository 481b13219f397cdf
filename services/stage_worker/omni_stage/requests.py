"""A replica's requests as a plain state machine: admission, per-request state, windows, order, credit.

No NATS, tasks or connectors here (omni_stage.proc wires those around it), so unit tests drive
it directly: admit a request, add its inputs and take the triggers they make, plan what a
segment sends to each consumer, count credit, abort, release. It decides, and the shells around
it do: which requests run (StageCore), which are refused and why (an Admitted with its
ErrorCode), when a request's window on an out-edge sends a chunk, with which sequence number,
and whether that chunk is charged to the edge's credit (CreditLedger).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Final

from opentelemetry.trace import INVALID_SPAN, Span

from omni_pipeline.connectors import OmniConnector
from omni_pipeline.control import Admitted, ErrorCode, RequestContext, SegmentMsg, StageRequest
from omni_pipeline.sampling import EMPTY, Sampling
from omni_pipeline.spec import REQUEST_SOURCE, StageSpec
from omni_stage.assembly import InputAssembler, Trigger
from omni_stage.core import Admission, StageCore
from omni_stage.credit import CreditLedger
from omni_stage.segments import Segment
from omni_stage.state import ReplicaState
from omni_stage.windows import Chunk, WindowState, is_read

Inbound = StageRequest | SegmentMsg
"""What reaches a stage for a request: the client's request, or a producer's chunk."""


@dataclass(frozen=True, slots=True)
class OutEdge:
    """An edge from this stage to a consumer, as the pipeline file says."""

    consumer: str
    window: int
    connector: OmniConnector
    credit: int
    first_window: int | None = None
    """The first chunk's units, where smaller than `window` (`firstWindow`)."""


@dataclass(eq=False)
class RequestState:
    """One request this replica holds, from admission to its end."""

    ctx: RequestContext
    assembler: InputAssembler[Inbound]
    triggers: asyncio.Queue[Trigger[Inbound]]
    """Bounded by the in-edges' credit: a producer never has more chunks unread than that."""
    windows: dict[str, WindowState]
    """Per consumer on the request's route: its out-edge's window over this request's output."""
    span: Span = INVALID_SPAN
    """The request's span on this replica, from admission to its end (set by the process)."""
    admitted_ns: int = field(default_factory=time.time_ns)
    sampling: Sampling = EMPTY
    task: asyncio.Task[str] | None = None
    """The task that runs it: None while it is queued."""
    credit_returned: asyncio.Event = field(default_factory=asyncio.Event)
    sequences: dict[str, int] = field(default_factory=dict)
    """The next chunk's sequence number, per consumer."""
    last_emit_at: float | None = None
    """When its last segment went out (monotonic), None before the first."""

    @property
    def request_id(self) -> str:
        return self.ctx.request_id


@dataclass(frozen=True, slots=True)
class Send:
    """One chunk of a request's output for one consumer, in the order it must go out."""

    edge: OutEdge
    sequence: int
    chunk: Chunk
    charged: bool
    """It counts against the edge's credit (the consumer reads it and gives the credit back)."""


class RequestBook:
    """Every request one replica holds, and the replica's state that decides admission."""

    def __init__(self, spec: StageSpec, out_edges: list[OutEdge], where: str, state: ReplicaState) -> None:
        self.spec = spec
        self.where = where
        """How refusals name this replica: `stage 'talker' replica 0`."""
        self.out_edges = out_edges
        self.in_windows = {e.from_: e.window for e in spec.inputs}
        self.is_source = REQUEST_SOURCE in self.in_windows
        self.defaults = Sampling.of(spec.sampling)
        """The pipeline file's sampling for this stage, under what a request asks."""
        self.state = state
        """The replica's phase and health, which admission refuses by."""
        self.core = StageCore(spec.max_inflight, spec.max_queued, state)
        self.ledger = CreditLedger({e.consumer: e.credit for e in out_edges})
        # Every chunk in flight to us is one credit: with the client request and an empty last
        # chunk, a request's triggers can never outgrow this.
        self.max_triggers: Final = sum(e.credit for e in spec.inputs) + 2
        self.requests: dict[str, RequestState] = {}

    # --- admission ---------------------------------------------------------------------------

    def admit(self, ctx: RequestContext) -> RequestState | Admitted:
        """A new request: its state (running, or queued if `task` stays None), or the refusal."""
        rid, where = ctx.request_id, self.where
        if self.spec.name not in ctx.route:
            return Admitted(False, ErrorCode.BAD_ROUTE, f"{where} is not on the route of request {rid}")
        windows = {p: w for p, w in self.in_windows.items() if p == REQUEST_SOURCE or p in ctx.route}
        if not windows:  # nothing on the route feeds this stage: it would wait for ever
            inputs = ", ".join(self.in_windows)
            why = f"{where}: none of its inputs ({inputs}) is on the route of request {rid}"
            return Admitted(False, ErrorCode.BAD_ROUTE, why)
        if unhealthy := self.state.unhealthy:
            why = f"{where} is unhealthy: {unhealthy}"
            return Admitted(False, ErrorCode.UNHEALTHY, why, unhealthy=unhealthy)
        if (unread := self.ledger.unread_bytes) >= self.spec.max_unread_bytes:
            why = (
                f"{where} is full: {unread} bytes of its output wait unread by its consumers "
                f"(maxUnreadBytes {self.spec.max_unread_bytes})"
            )
            return Admitted(False, ErrorCode.FULL, why)
        if self.core.known(rid):  # ids are made unique by the gateway; never let one clash
            return Admitted(False, ErrorCode.DUPLICATE_REQUEST, f"{where} already holds request {rid}")
        admission = self.core.admit(rid, ctx.priority)
        if admission is Admission.REJECT_DRAINING:
            return Admitted(False, ErrorCode.DRAINING, f"{where} is draining")
        if admission is Admission.REJECT_SLEEPING:
            return Admitted(False, ErrorCode.SLEEPING, f"{where} is asleep (level {self.state.level})")
        if admission is Admission.REJECT_FULL:
            return Admitted(False, ErrorCode.FULL, f"{where} is full")
        edges = [e for e in self.out_edges if e.consumer in ctx.route]
        out = {e.consumer: WindowState(e.window, e.first_window) for e in edges}
        st = RequestState(ctx, InputAssembler(windows), asyncio.Queue(self.max_triggers), out)
        self.requests[rid] = st
        return st

    def runs_now(self, st: RequestState) -> bool:
        """Whether an admitted request runs at once (not queued)."""
        return st.request_id in self.core.running

    def take_request(self, st: RequestState, m: StageRequest, honoured: frozenset[str]) -> bool:
        """Its StageRequest: take its sampling (all of it at a source stage; elsewhere only the
        `honoured` keys, so a talker never takes the thinker's max_tokens), then what the
        client asked of this stage alone. True if the request
        itself is an input (a source stage); otherwise it only reserved a slot."""
        asked = m.sampling if self.is_source else m.sampling.only(honoured)
        st.sampling = m.own.over(asked.over(self.defaults))
        return self.is_source

    def add_input(
        self, st: RequestState, producer: str, sequence: int, m: Inbound, units: int, is_last: bool
    ) -> None:
        """An input arrived: queue the triggers it completes (AssemblyError, QueueFull: the
        request's input stream is broken)."""
        for trigger in st.assembler.add(producer, sequence, m, units, is_last):
            st.triggers.put_nowait(trigger)

    # --- running -----------------------------------------------------------------------------

    def start(self, st: RequestState) -> None:
        """Its task is about to run: open its credit account on the out-edges of its route."""
        self.ledger.open(st.request_id, st.ctx.deadline, list(st.windows))

    def plan(self, st: RequestState, seg: Segment) -> list[Send]:
        """What a segment sends on, per out-edge of the route, numbered in order."""
        sends = []
        for edge in self.out_edges:
            if (ws := st.windows.get(edge.consumer)) is None:
                continue
            for chunk in ws.push(seg.data, seg.units, seg.is_last):
                seq = st.sequences.get(edge.consumer, 0)
                st.sequences[edge.consumer] = seq + 1
                sends.append(Send(edge, seq, chunk, is_read(edge.window, chunk.units)))
        return sends

    def credit(self, st: RequestState, consumer: str) -> int:
        return self.ledger.available(st.request_id, consumer)

    def sent(self, st: RequestState, send: Send, nbytes: int) -> None:
        if send.charged:
            self.ledger.sent(st.request_id, send.edge.consumer, nbytes)

    def credit_back(self, rid: str, consumer: str, chunks: int) -> None:
        """A consumer read `chunks` of a request's chunks: wake the request if it waits for them."""
        if self.ledger.returned(rid, consumer, chunks) and (st := self.requests.get(rid)) is not None:
            st.credit_returned.set()

    def pause(self, st: RequestState) -> list[RequestState]:
        """It waits for credit: its slot goes to queued requests (returned, to start)."""
        return self._states(self.core.pause(st.request_id))

    def resume(self, st: RequestState) -> None:
        self.core.resume(st.request_id)

    def sent_all(self, st: RequestState) -> None:
        """Its last chunk went out: its account goes once the consumers have read it all."""
        self.ledger.close(st.request_id)

    # --- ending ------------------------------------------------------------------------------

    def ended(self, rid: str, ok: bool) -> list[RequestState]:
        """Its task ended (ok: it completed); returns the queued requests that start now."""
        if not ok:
            self.core.abort(rid)
            self.ledger.forget(rid)
        self.requests.pop(rid, None)
        return self._states(self.core.release(rid))

    def abort(self, rid: str) -> tuple[RequestState | None, bool]:
        """Mark it aborted; returns its state (if held) and whether its task runs (to cancel; its
        end frees it). Otherwise a queued request is dropped here."""
        running = self.core.abort(rid)
        st = self.requests.get(rid)
        if not running or st is None or st.task is None:
            self.requests.pop(rid, None)
            self.ledger.forget(rid)
            return st, False
        return st, True

    def is_aborted(self, rid: str) -> bool:
        return self.core.is_aborted(rid)

    def knows(self, rid: str) -> bool:
        return self.core.known(rid)

    def has_work(self) -> bool:
        return self.core.has_work()

    def _states(self, rids: list[str]) -> list[RequestState]:
        return [st for rid in rids if (st := self.requests.get(rid)) is not None]
