"""The requests one gateway owns, each from its admission to its end, and what reaches them.

Each attempt of a request is tracked here while it runs: its route (stage -> replica, to notice
when a replica it uses dies), its bounded queue of what its final stages send, and its first
failure. Messages from the gateway's inbox land in their attempt's queue; one whose attempt
already ended has its payload freed at once. Every attempt ends exactly once (`end`): its
replicas are released, and unless it completed, an abort goes to every replica and its
payloads are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from opentelemetry.context import Context

from omni_gateway.replicas import Replica, ReplicaTable
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import AbortMsg, ErrorCode, ErrorMsg, FinalMsg, GatewayInbound, StageDone

log = logging.getLogger("omni.gateway")

EVENT_QUEUE: Final = 1024
"""Outputs one request may have waiting for its client; a client this far behind is dropped."""


@dataclass
class Tracked:
    """One attempt of a request, while it runs."""

    request_id: str
    route: dict[str, tuple[str, str]]
    """stage -> (replica id, instance), for the stages still to finish their part."""
    final_stages: set[str]
    queue: asyncio.Queue[GatewayInbound] = field(default_factory=lambda: asyncio.Queue(EVENT_QUEUE))
    failed: ErrorMsg | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it has failed: what still waits for it (its admissions) stops waiting."""
    trace: Context | None = None
    """The attempt's span, as the parent of what is done for it."""
    stage_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage on the route, from its last message: what it read and made."""
    started: float = field(default_factory=time.monotonic)
    first_output: dict[str, float] = field(default_factory=dict)
    """Per final stage: when its first output came (monotonic)."""
    done: dict[str, float] = field(default_factory=dict)
    """Per stage on the route: when its last message came (monotonic)."""


class Inflight:
    """The attempts this gateway runs, by request id."""

    def __init__(
        self,
        gateway_id: str,
        table: ReplicaTable,
        payloads: OffLoop,
        abort: Callable[[AbortMsg], Awaitable[None]],
    ) -> None:
        self.gateway_id = gateway_id
        self.table = table
        self.payloads = payloads
        self.abort = abort
        """Broadcast an abort to every replica (while NATS is away: once it is back)."""
        self.attempts: dict[str, Tracked] = {}
        self._ended_by_outage: set[str] = set()

    def __len__(self) -> int:
        return len(self.attempts)

    def add(self, t: Tracked) -> None:
        self.attempts[t.request_id] = t

    async def end(self, rid: str, completed: bool, reason: str) -> None:
        """The attempt ended: release its replicas; unless it completed, abort it everywhere and
        free its payloads."""
        t = self.attempts.pop(rid, None)
        if t is None:
            return
        for stage, (_, instance) in t.route.items():
            self.table.release(stage, instance)
        if completed:
            return
        await self.abort(AbortMsg(rid, reason))
        self.payloads.cleanup(rid)

    def fail(self, t: Tracked, message: str, code: ErrorCode) -> None:
        """End the attempt with the gateway's own error (its first failure wins)."""
        if t.failed is None:
            t.failed = ErrorMsg(t.request_id, "gateway", self.gateway_id, message, code)
            t.ended.set()
            with contextlib.suppress(asyncio.QueueFull):
                t.queue.put_nowait(t.failed)

    def received(self, m: FinalMsg | ErrorMsg | StageDone) -> None:
        """A message on the gateway's inbox, for the attempt it names."""
        t = self.attempts.get(m.request_id)
        part_done = isinstance(m, StageDone) or (isinstance(m, FinalMsg) and m.is_last)
        if t is not None and isinstance(m, FinalMsg):
            t.first_output.setdefault(m.stage, time.monotonic())
        if t is not None and part_done and (done := t.route.pop(m.stage, None)) is not None:
            self.table.release(m.stage, done[1])  # and its loss no longer matters to the request
            t.done[m.stage] = time.monotonic()
            if m.usage:
                t.stage_usage[m.stage] = dict(m.usage)
        if isinstance(m, StageDone):
            return
        if t is None:
            # A late output of a request that already ended: free its payload, if any.
            if isinstance(m, FinalMsg) and m.handle is not None:
                self.payloads.discard(m.request_id, m.handle)
            return
        try:
            t.queue.put_nowait(m)
        except asyncio.QueueFull:
            while not t.queue.empty():  # what the client will never read: drop it, free its payloads
                t.queue.get_nowait()
            self.payloads.cleanup(m.request_id)
            self.fail(t, "the client is not reading its response fast enough", ErrorCode.CLIENT_TOO_SLOW)

    def replica_gone(self, r: Replica, why: str) -> None:
        """Fail each attempt that still needs the replica."""
        stage, replica = r.hb.stage, r.hb.replica
        log.warning("gateway: %s/%s (instance %s) %s", stage, replica, r.hb.instance, why)
        for t in list(self.attempts.values()):
            if t.route.get(stage) == (replica, r.hb.instance):
                lost = f"stage '{stage}' replica {replica} {why} while serving this request"
                self.fail(t, lost, ErrorCode.REPLICA_LOST)

    def end_all_for_outage(self) -> None:
        """NATS is lost: outputs sent while we are away are lost, so no attempt in flight can
        finish. End them now rather than at their deadline (their aborts go out once NATS is
        back)."""
        self._ended_by_outage.update(self.attempts)
        for t in list(self.attempts.values()):
            why = "the gateway lost its connection to NATS while serving this request"
            self.fail(t, why, ErrorCode.NATS_LOST)

    def free_again_after_outage(self) -> None:
        """NATS is back. Free the requests the outage ended once more: a stage may have been
        writing a payload for one when we freed it first (a write in progress is not freed),
        and its message saying so was lost with the server."""
        for rid in self._ended_by_outage:
            self.payloads.cleanup(rid)
        self._ended_by_outage.clear()
