"""The gateway's side of NATS: its connection, its inbox, the replica table the heartbeats keep,
and the two conversations a request has with replicas (admission, abort).

Heartbeats keep the replica table (omni_gateway.replicas); a replica that restarted, stopped
or went silent fails the attempts that still need it. A lost connection ends every attempt in
flight at once. Replies on the gateway's own inbox go to the attempt they name
(omni_gateway.inflight). Waiting for a replica (one restarting, NATS away) is bounded: at most
maxWaitingRequests wait, each at most replicaWaitS and within its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from omni_gateway.errors import BadRequest, OmniError, PayloadTooLarge, StageFailed, Timeout, Unavailable
from omni_gateway.inflight import Inflight, Tracked
from omni_gateway.replicas import Replica, ReplicaTable
from omni_pipeline import tracing, wire
from omni_pipeline.connection import close_nats, connect_nats
from omni_pipeline.connectors import reclaim_unread
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import (
    HEARTBEAT_INTERVAL_S,
    AbortMsg,
    Admitted,
    ErrorCode,
    GatewayInbound,
    Heartbeat,
    Subjects,
    pack,
    unpack,
)
from omni_pipeline.spec import PipelineSpec

log = logging.getLogger("omni.gateway")

ADMIT_TIMEOUT_S: Final = 5.0
"""How long a replica may take to admit a request before it counts as lost."""
RETRY_AFTER: Final = {"Retry-After": "1"}
ERRORS: Final = {
    ErrorCode.NATS_LOST: Unavailable,
    ErrorCode.SLEEPING: Unavailable,
    ErrorCode.INVALID_REQUEST: BadRequest,
    ErrorCode.DEADLINE_EXCEEDED: Timeout,
}
"""Stage error codes that are not a stage's failure: the client's request, or our connection."""


@dataclass(eq=False)
class Bus:
    """One gateway's NATS connection and what it hears."""

    spec: PipelineSpec
    subjects: Subjects
    gateway_id: str
    nats_url: str
    payloads: OffLoop
    nc: NatsClient | None = field(default=None, init=False)
    covered: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    """Every stage that should have replicas has one up (the gateway can serve)."""
    inbox: str = field(init=False)
    table: ReplicaTable = field(init=False)
    inflight: Inflight = field(init=False)
    _sweeper: asyncio.Task[None] | None = field(default=None, init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _waiting: int = field(default=0, init=False)
    """Requests waiting for a replica or for NATS (at most maxWaitingRequests)."""

    def __post_init__(self) -> None:
        self.inbox = self.subjects.gateway_inbox(self.gateway_id)
        self.table = ReplicaTable(self.inbox)
        self.inflight = Inflight(self.gateway_id, self.table, self.payloads, self.abort)

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Connect and subscribe; False if `stop` was set before NATS could be reached."""
        nc = await connect_nats(
            self.nats_url,
            f"gateway-{self.gateway_id}",
            stop=stop,
            on_disconnect=self.inflight.end_all_for_outage,
            on_reconnect=self._on_nats_back,
        )
        if nc is None:
            return False
        self.nc = nc
        await nc.subscribe(self.inbox, cb=self._on_reply)
        await nc.subscribe(self.subjects.heartbeat, cb=self._on_heartbeat)
        self._sweeper = asyncio.get_running_loop().create_task(self._expire_replicas(), name="replica-expiry")
        return True

    async def stop(self) -> None:
        for rid in list(self.inflight.attempts):
            await self.inflight.end(rid, completed=False, reason="gateway shutting down")
        if self._sweeper:
            self._sweeper.cancel()
        if self.nc is not None:
            await close_nats(self.nc)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def ready(self) -> bool:
        return self.connected and self.table.covers([s.name for s in self.spec.stages if s.replicas > 0])

    def sized(self, data: bytes, advice: str = "") -> bytes:
        """`data`, a request packed for one NATS message, if it fits the server's limit; else the
        client's 413 naming the limit (and `advice`: what would carry it)."""
        if self.nc is not None and len(data) > self.nc.max_payload:
            raise PayloadTooLarge(
                f"the request is {len(data)} bytes as a NATS message, over the server's limit of "
                f"{self.nc.max_payload}{advice}"
            )
        return data

    # --- replicas ----------------------------------------------------------------------------

    async def pick(self, stage: str, deadline: float, prefer: str | None = None) -> Replica:
        """A replica of `stage` for a new attempt (`prefer`: the instance to pick where it can,
        ReplicaTable.pick). While NATS is away or the stage has no live
        replica (one restarting), wait for it, within the request's deadline and replicaWaitS,
        as one of at most maxWaitingRequests; then the 503 says what was missing. Replicas
        that are up but unhealthy (a connector's backend down) are a 503 at once, naming why."""
        gw = self.spec.gateway
        until = min(deadline, time.monotonic() + gw.replica_wait_s)
        waiting = False
        try:
            while True:
                changed = self._changed
                try:
                    if not self.connected:
                        raise Unavailable("the gateway is not connected to NATS", headers=RETRY_AFTER)
                    return self.table.pick(stage, prefer)
                except Unavailable as exc:
                    if self.connected and (self.table.sick(stage) or self.table.asleep(stage)):
                        raise  # its replicas are up but cannot serve (a backend down, asleep): say so now
                    if not waiting and self._waiting >= gw.max_waiting_requests:
                        raise
                    if not waiting:
                        waiting, self._waiting = True, self._waiting + 1
                    try:
                        async with asyncio.timeout(until - time.monotonic()):
                            await changed.wait()
                    except TimeoutError:
                        raise exc from None
        finally:
            if waiting:
                self._waiting -= 1

    async def until_table(self, settled: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `settled()` holds of the replica table (heartbeats change it); False if it
        did not within `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not settled():
                    await self._changed.wait()
                return True
        return False

    def _table_changed(self) -> None:
        """Wake the requests waiting for a replica or for NATS, to look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    # --- admission and abort -----------------------------------------------------------------

    async def reserve(self, t: Tracked, requests: dict[str, bytes]) -> None:
        """Send each stage's request to its replica and wait until every one has admitted it, or
        until the attempt fails meanwhile: NATS lost (an admission sent as the server died is
        lost with it, and would otherwise be waited for until ADMIT_TIMEOUT_S)."""
        assert self.nc is not None
        nc = self.nc

        async def ask(stage: str, request: bytes) -> None:
            replica, instance = t.route[stage]
            # The parent of the stage's own span: the message carries this one's context. An
            # exception leaving it marks it failed.
            attributes = {"omni.stage": stage, "omni.replica": replica}
            with tracing.span("omni.admit", t.trace, SpanKind.CLIENT, attributes):
                where = f"stage '{stage}' replica {replica}"
                try:
                    reply = await nc.request(
                        self.subjects.stage_inbox(stage, replica),
                        request,
                        timeout=ADMIT_TIMEOUT_S,
                        headers=tracing.headers(),
                    )
                except nats.errors.NoRespondersError:
                    if (gone := self.table.remove(stage, instance)) is not None:
                        self.inflight.replica_gone(gone, "is gone")  # fail what it held, as expiry would
                    raise StageFailed(f"{where} is gone", code=ErrorCode.REPLICA_LOST) from None
                except (TimeoutError, nats.errors.TimeoutError):
                    why = f"{where} did not answer in {ADMIT_TIMEOUT_S:.0f}s"
                    raise StageFailed(why, code=ErrorCode.REPLICA_LOST) from None
                try:
                    answer: Admitted = unpack(reply.data, Admitted)
                except wire.WireError as exc:
                    raise StageFailed(f"{where} answered with an invalid message: {exc}") from None
                if not answer.ok:
                    self.table.refused(stage, instance, answer)
                    raise ERRORS.get(answer.code, StageFailed)(answer.message, code=answer.code)

        admissions = asyncio.gather(*(ask(s, r) for s, r in requests.items()))
        ended = asyncio.ensure_future(t.ended.wait())
        try:
            await asyncio.wait({admissions, ended}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the request itself cancelled (its client left): so are they
            admissions.cancel()
            raise
        finally:
            ended.cancel()
        if not admissions.done():
            admissions.cancel()
            with contextlib.suppress(asyncio.CancelledError, OmniError):
                await admissions
            assert t.failed is not None
            raise ERRORS.get(t.failed.code, StageFailed)(t.failed.message, code=t.failed.code)
        admissions.result()  # what an admission raised, if one did

    async def abort(self, msg: AbortMsg) -> None:
        if self.nc is not None and not self.nc.is_closed:  # while reconnecting, sent once back
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.abort, pack(msg))

    # --- what NATS brings --------------------------------------------------------------------

    def _on_nats_back(self) -> None:
        self.table.heard_all(time.monotonic())
        self._table_changed()
        self.inflight.free_again_after_outage()

    async def _on_reply(self, msg: Msg) -> None:
        try:
            m = unpack(msg.data, GatewayInbound)
        except wire.WireError as exc:
            log.warning("gateway: refused a message on its inbox: %s", exc)
            return
        self.inflight.received(m)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb: Heartbeat = unpack(msg.data, Heartbeat)
        except wire.WireError as exc:
            log.warning("gateway: refused a heartbeat: %s", exc)
            return
        known = self.table.get(hb.stage, hb.instance) is not None
        for dead in self.table.update(hb, time.monotonic()):
            self.inflight.replica_gone(dead, "restarted")
        if (now_known := self.table.get(hb.stage, hb.instance) is not None) != known:
            said = "joined" if now_known else "stopped"
            log.info("gateway: %s/%s (instance %s) %s", hb.stage, hb.replica, hb.instance, said)
        if self.ready():
            self.covered.set()
        self._table_changed()

    async def _expire_replicas(self) -> None:
        woke = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)  # the expiry period, not synchronisation
            now = time.monotonic()
            late, woke = now - woke - HEARTBEAT_INTERVAL_S, now
            if not self.connected or late > HEARTBEAT_INTERVAL_S:
                # Silence we could not hear proves nothing: NATS was away, or this process was
                # stalled (CPU starvation, a pause) and the beats sent meanwhile still wait
                # unread in our subscription. Missed beats count again from now.
                self.table.heard_all(now)
                continue
            for r in self.table.expire(now):
                self.inflight.replica_gone(r, "stopped sending heartbeats")
            await asyncio.to_thread(reclaim_unread, list(self.payloads.connectors.values()), self.spec)
            if not self.ready():
                self.covered.clear()
