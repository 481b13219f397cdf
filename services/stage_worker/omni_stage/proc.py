"""The stage replica process: NATS in, engine, connectors, NATS out (seed 000's worker loop).

One asyncio loop owns all state. The NATS callbacks only decode and hand messages to the
request's state; each running request is one task that takes triggers from its bounded
queue, runs the engine, flushes segments and applies each out-edge's window. The engine's
heavy work runs in threads, so heartbeats, aborts and new inputs keep flowing meanwhile.

Ownership: a request's task owns its engine state and, on error or abort, frees whatever the
request holds in every connector (`cleanup`). A consumer frees a payload once it reads it,
and returns the producer one chunk of credit for it (omni_stage.credit): a request with no
credit left on an out-edge pauses between engine steps until its consumer catches up.

Sleep (the control subject's SleepMsg, or the stage's `paused` in the pipeline file, which the
replica rereads while it runs): it stops admitting, ends what it holds, and has its engine
free memory; a WakeMsg (or `paused` set false) undoes it. The replica stays up and beating
throughout, so gateways know to answer 503 for what needs it rather than wait for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, StatusCode
from setproctitle import setproctitle

from omni_pipeline import tracing, wire
from omni_pipeline.connectors import (
    ConnectorError,
    ConnectorHandle,
    OmniConnector,
    PayloadGone,
    build_connectors,
    check_request_id,
    reclaim_unread,
)
from omni_pipeline.control import (
    HEARTBEAT_INTERVAL_S,
    AbortMsg,
    Admitted,
    ControlInbound,
    CreditMsg,
    ErrorCode,
    ErrorMsg,
    FinalMsg,
    Heartbeat,
    RequestContext,
    SegmentMsg,
    SleepAck,
    SleepMsg,
    StageDone,
    StageInbound,
    StageRequest,
    Subjects,
    close_nats,
    connect_nats,
    pack,
    unpack,
)
from omni_pipeline.logs import REQUEST_ID, configure_logging
from omni_pipeline.placement import VISIBLE_DEVICES_ENV
from omni_pipeline.serving import listen, make_server, on_shutdown_signals
from omni_pipeline.spec import (
    DEFAULT_CONNECTOR,
    REQUEST_SOURCE,
    OutputKind,
    PipelineFile,
    SpecError,
    StageSpec,
    load_pipeline,
)
from omni_pipeline.tracing import TRACER, configure_tracing, shutdown_tracing
from omni_stage.assembly import AssemblyError, InputAssembler, Trigger
from omni_stage.core import Admission, StageCore
from omni_stage.credit import CreditLedger
from omni_stage.engines.base import Engine, EngineCall, EngineError, InvalidRequest, import_object
from omni_stage.engines.registry import build_engine
from omni_stage.health import health_app
from omni_stage.metrics import StageMetrics
from omni_stage.segments import Segment, Segmenter
from omni_stage.windows import WindowState, is_read

log = logging.getLogger("omni.stage")

DRAIN_TIMEOUT_S: Final = 120.0

Inbound = StageRequest | SegmentMsg


@dataclass
class _Request:
    ctx: RequestContext
    assembler: InputAssembler[Inbound]
    triggers: asyncio.Queue[Trigger[Inbound]]
    """Bounded by the in-edges' credit: a producer never has more chunks unread than that."""
    span: Span
    """The request's span on this replica, from admission to its end."""
    admitted_ns: int = field(default_factory=time.time_ns)
    sampling: dict[str, Any] = field(default_factory=dict)
    task: asyncio.Task[str] | None = None
    credit_returned: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class _OutEdge:
    consumer: str
    window: int
    connector: OmniConnector
    credit: int


class StageWorker:
    """One replica of one stage."""

    def __init__(
        self,
        pipeline: PipelineFile,
        stage: str,
        replica: str,
        nats_url: str,
        pipeline_path: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.pipeline_path = pipeline_path
        """The file `pipeline` was read from, reread for the stage's `paused` while we run."""
        self.spec: StageSpec = pipeline.spec.stage(stage)
        self.replica = replica
        self.nats_url = nats_url
        self.instance = uuid.uuid4().hex[:12]
        self.subjects = Subjects(pipeline.name)
        self.inbox = self.subjects.stage_inbox(stage, replica)
        self.core = StageCore(self.spec.max_inflight, self.spec.max_queued)
        self.metrics = StageMetrics(stage, replica)
        self.connectors = build_connectors(pipeline.spec, pipeline.name)
        self.final_connector = self.connectors[DEFAULT_CONNECTOR]
        self.in_windows = {e.from_: e.window for e in self.spec.inputs}
        self.in_connectors = {e.from_: self.connectors[e.connector] for e in self.spec.inputs}
        self.processors: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            e.from_: import_object(e.processor) for e in self.spec.inputs if e.processor
        }
        self.out_edges = [
            _OutEdge(s.name, e.window, self.connectors[e.connector], e.credit)
            for s, e in pipeline.spec.consumers(stage)
        ]
        self.ledger = CreditLedger({e.consumer: e.credit for e in self.out_edges})
        # Every chunk in flight to us is one credit: with the client request and an empty last
        # chunk, a request's triggers can never outgrow this.
        self.max_triggers = sum(e.credit for e in self.spec.inputs) + 2
        self.engine: Engine = build_engine(self.spec)
        self.requests: dict[str, _Request] = {}
        self.nc: NatsClient | None = None
        self.ready = False
        self.unhealthy = ""
        """Why the replica takes nothing new for now (a connector's backend is down)."""
        self.engine_dead: str | None = None
        """Why the engine can serve nothing more: the replica fails what it holds and exits."""
        self.metrics_port = 0
        self.asleep: int | None = None
        """The sleep level the replica is at (or going to); None while awake."""
        self._sleep_lock = asyncio.Lock()  # one sleep or wake at a time, in the order asked
        self._paused = self.spec.paused
        self._file_stamp = _stamp(pipeline_path)
        self._control: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        self._drained = asyncio.Event()
        self._notices: set[asyncio.Task[None]] = set()  # error notices waiting for NATS to return
        self._ended_by_outage: set[str] = set()  # freed again when NATS is back

    # --- lifecycle ---------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str, str]:
        """Ready or not, the status word and why. A sleeping replica is ready (Kubernetes must
        not hold a rollout or restart for it; it is up and doing as told): `sleeping`."""
        if self.engine_dead is not None:
            return False, "not ready", f"engine dead: {self.engine_dead}"
        if not self.ready:
            return False, "not ready", "starting"
        if self.unhealthy:
            return False, "not ready", self.unhealthy
        if self.core.draining:
            return False, "not ready", "draining"
        if self.nc is None or not self.nc.is_connected:
            return False, "not ready", "NATS disconnected"
        if self.asleep is not None:
            return True, "sleeping", f"asleep at level {self.asleep}"
        return True, "ready", "ok"

    async def run(
        self, on_ready: Callable[[dict[str, Any]], None], metrics_host: str, metrics_port: int
    ) -> None:
        on_shutdown_signals(self.begin_drain)
        sock = listen(metrics_host, metrics_port)
        self.metrics_port = sock.getsockname()[1]
        server = make_server(
            health_app(self.metrics.registry, self.readiness, self._refresh_gauges), lifespan="off"
        )
        http = asyncio.create_task(server.serve(sockets=[sock]), name="health-http")
        try:
            log.info(
                "stage %s/%s: loading engine %s (CUDA_VISIBLE_DEVICES=%s)",
                self.spec.name,
                self.replica,
                self.spec.engine.kind,
                os.environ.get(VISIBLE_DEVICES_ENV, "unset"),
            )
            await self.engine.start()
            nc = await connect_nats(
                self.nats_url,
                f"stage-{self.spec.name}-{self.replica}",
                stop=self._stop,
                on_disconnect=self._on_nats_lost,
                on_reconnect=self._on_nats_back,
            )
            if nc is None:
                log.info("stage %s/%s: stopped before NATS was reachable", self.spec.name, self.replica)
                return
            self.nc = nc
            await self.nc.subscribe(self.inbox, cb=self._on_inbound)
            await self.nc.subscribe(self.subjects.abort, cb=self._on_abort)
            await self.nc.subscribe(self.subjects.control, cb=self._on_control)
            if self._paused:  # before it is ready: a paused stage's new replica starts asleep
                await self._sleep(self.engine.max_sleep_level, "wait")
            self.ready = True
            hb = asyncio.create_task(self._heartbeats(), name="heartbeat")
            checks = asyncio.create_task(self._health_checks(), name="health-checks")
            await self._publish_heartbeat()
            await self.nc.flush()
            on_ready({"stage": self.spec.name, "replica": self.replica, "metrics_port": self.metrics_port})
            log.info(
                "stage %s/%s ready (inbox %s, metrics :%d)",
                self.spec.name,
                self.replica,
                self.inbox,
                self.metrics_port,
            )
            await self._stop.wait()
            if self.engine_dead is None:
                await self._finish_drain()
            hb.cancel()
            checks.cancel()
            for task in self._control:
                task.cancel()
            await self._fail_held(
                "stopped before finishing this request"
                if self.engine_dead is None
                else f"lost its engine ({self.engine_dead})"
            )
            await self._publish_heartbeat(stopping=True)
        finally:
            for st in list(self.requests.values()):
                if st.task:
                    st.task.cancel()
            if self.nc is not None:
                await close_nats(self.nc)
            server.should_exit = True
            await http
            await self.engine.close()
            for c in self.connectors.values():
                c.close()
        if self.engine_dead is not None:  # a non-zero exit: the supervisor (or kubelet) restarts us
            raise EngineDead(f"stage {self.spec.name}/{self.replica}: {self.engine_dead}")

    def begin_drain(self) -> None:
        """SIGTERM: take no new requests, finish the ones we have, then stop. Twice: stop now."""
        if self.core.draining:
            log.warning("stage %s/%s: second signal, stopping now", self.spec.name, self.replica)
            self._drained.set()
            self._stop.set()
            return
        log.info("stage %s/%s: draining %d requests", self.spec.name, self.replica, len(self.requests))
        self.core.draining = True
        self._stop.set()
        if self.nc is not None:
            asyncio.get_running_loop().create_task(self._publish_heartbeat())

    async def _finish_drain(self) -> None:
        if self.core.has_work():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    await self._drained.wait()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)  # the heartbeat period itself
            await self._publish_heartbeat()

    async def _health_checks(self) -> None:
        """Beside the heartbeats, never in their way: a check may wait on a backend's timeout."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            for rid in self.ledger.expire(time.time(), keep=self.requests):
                log.info("stage %s: request %s: its unread output expired", self.spec.name, rid)
            await asyncio.to_thread(reclaim_unread, list(self._used_connectors()), self.pipeline.spec)
            await self._check_health()
            await self._follow_paused()

    async def _check_health(self) -> None:
        """The engine's and the connectors' own word on whether this replica can serve: a dead
        engine stops the replica (to be restarted); a connector whose backend is down makes it
        take nothing new until the backend answers again."""
        why = self.engine.dead()
        busy, limit = self.engine.busy_s(), self.spec.step_timeout_s
        if why is None and busy is not None and limit is not None and busy > limit:
            why = f"wedged: a forward has run for {busy:.0f}s, over stepTimeoutSeconds ({limit:g}s)"
        if why is not None:
            log.error(
                "stage %s/%s: engine dead: %s; failing what it holds", self.spec.name, self.replica, why
            )
            self.engine_dead = why
            self._drained.set()
            self._stop.set()
            return
        # Off the event loop: a backend that is down may take its timeout to say so.
        health = await asyncio.to_thread(lambda: [(c, c.health()) for c in self._used_connectors()])
        unhealthy = "; ".join(
            f"connector '{c.name}' ({c.kind}): {h.get('status') or h.get('error') or 'unhealthy'}"
            for c, h in sorted(health, key=lambda ch: ch[0].name)
            if not h.get("ok", False)
        )
        if unhealthy != self.unhealthy:
            now = unhealthy or "connectors healthy again"
            log.warning("stage %s/%s: %s", self.spec.name, self.replica, now)
        self.unhealthy = unhealthy

    def _used_connectors(self) -> set[OmniConnector]:
        """The connectors this stage reads or writes through (every process builds them all)."""
        return {*self.in_connectors.values(), *(e.connector for e in self.out_edges), self.final_connector}

    def _refresh_gauges(self) -> None:
        load = self.core.load()
        self.metrics.queued.set(load.queued)
        self.metrics.inflight.set(load.inflight)
        self.metrics.paused.set(load.paused)
        self.metrics.tracked.set(len(self.requests))
        self.metrics.unread_bytes.set(self.ledger.unread_bytes)
        self.metrics.credit_accounts.set(self.ledger.tracked())
        self.metrics.resources.refresh(self.nc, self.connectors.values())
        if (held := self.engine.active_requests()) is not None:
            self.metrics.engine_requests.set(held)
        if (steps := self.engine.steps_run()) is not None:
            self.metrics.engine_steps_reached(steps)
        self.metrics.sleep_level.set(-1 if self.asleep is None else self.asleep)
        if (weights := self.engine.weight_bytes()) is not None:
            self.metrics.weights_held(weights)

    async def _publish_heartbeat(self, stopping: bool = False) -> None:
        # No gauge refresh here (/metrics does its own): counting a connector's objects may wait
        # on its backend (Mooncake's master, when it is gone), and a beat must never wait.
        load = self.core.load()
        hb = Heartbeat(
            stage=self.spec.name,
            replica=self.replica,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            queued=load.queued,
            inflight=load.inflight,
            capacity=load.capacity,
            max_queued=load.max_queued,
            draining=self.core.draining,
            interval_s=HEARTBEAT_INTERVAL_S,
            unhealthy=self.unhealthy,
            metrics_port=self.metrics_port,
            stopping=stopping,
            by_gateway=dict(collections.Counter(st.ctx.reply_to for st in self.requests.values())),
            accepts=sorted(self.engine.accepts),
            honours=sorted(self.engine.honours),
            voices=list(self.engine.voices),
            asleep=self.asleep,
            max_sleep_level=self.engine.max_sleep_level,
        )
        if self.nc is not None and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.heartbeat, pack(hb))

    def _on_nats_lost(self) -> None:
        """What we sent just before the drop may be lost, so no request we hold can be trusted to
        finish: end each now (its error goes out once NATS is back), not at its deadline."""
        held = [st.ctx for st in self.requests.values()]
        why = f"stage '{self.spec.name}' replica {self.replica} lost its connection to NATS"
        for ctx in held:
            self._ended_by_outage.add(ctx.request_id)
            self._abort(ctx.request_id)
        if held:
            task = asyncio.get_running_loop().create_task(self._fail_all(held, why))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    def _on_nats_back(self) -> None:
        """Free the requests the outage ended once more: another stage may have been writing a
        payload for one when we freed it first (a write in progress is not freed), and its
        message saying so was lost with the server."""
        for rid in self._ended_by_outage:
            self._cleanup(rid)
        self._ended_by_outage.clear()

    async def _fail_held(self, why: str) -> None:
        """Before the stopping beat, on the same connection as every other message about them:
        a gateway learns each request's end from its own inbox, never from the beat."""
        where = f"stage '{self.spec.name}' replica {self.replica}"
        for st in list(self.requests.values()):
            await self._fail(st.ctx, f"{where} {why}", ErrorCode.REPLICA_LOST)

    async def _fail_all(self, held: list[RequestContext], why: str) -> None:
        for ctx in held:
            await self._fail(ctx, f"{why} while serving this request", ErrorCode.NATS_LOST)

    # --- sleep and wake ----------------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        try:
            m: ControlInbound = unpack(msg.data, ControlInbound)
        except wire.WireError as exc:
            log.warning("stage %s: refused a control message: %s", self.spec.name, exc)
            return
        if self.spec.name not in m.stages:
            return
        # In a task of its own: a sleep that waits for requests to finish must not hold up this
        # subscription (a wake behind it), and the lock keeps them in the order they came.
        work = self._sleep(m.level, m.mode) if isinstance(m, SleepMsg) else self._wake()
        self._spawn_control(work, msg.reply)

    def _spawn_control(self, work: Coroutine[Any, Any, SleepAck], reply: str | None = None) -> None:
        async def run() -> None:
            ack = await work
            if reply and self.nc is not None:
                with contextlib.suppress(Exception):
                    await self.nc.publish(reply, pack(ack))

        task = asyncio.get_running_loop().create_task(run(), name="sleep-or-wake")
        self._control.add(task)
        task.add_done_callback(self._control.discard)

    async def _sleep(self, level: int, mode: str) -> SleepAck:
        """Stop admitting, end what the replica holds (`abort`: fail it; `wait`: let it finish),
        then have the engine free memory by `level`. Asleep already (as deep or deeper): done."""
        async with self._sleep_lock:
            before = self._held_now()
            if level > self.engine.max_sleep_level:
                why = f"its engine can sleep at most at level {self.engine.max_sleep_level}"
                return self._ack(False, before, why)
            if self.asleep is not None and self.asleep >= level:
                return self._ack(True, before)
            log.info("stage %s/%s: going to sleep (level %d, %s)", self.spec.name, self.replica, level, mode)
            self.core.sleeping, self.asleep = True, level
            await self._publish_heartbeat()  # gateways stop routing here now, not at the next beat
            if mode == "abort":
                why = f"stage '{self.spec.name}' replica {self.replica} was put to sleep"
                for st in list(self.requests.values()):
                    await self._fail(st.ctx, f"{why} while serving this request", ErrorCode.SLEEPING)
                    self._abort(st.ctx.request_id)
            self._idle.clear()
            if self.core.has_work():
                await self._idle.wait()
            try:
                await self.engine.sleep(level)
            except Exception as exc:
                self._engine_failed(f"sleep at level {level} failed: {type(exc).__name__}: {exc}")
                return self._ack(False, before, str(exc))
            log.info("stage %s/%s: asleep at level %d", self.spec.name, self.replica, level)
            return self._ack(True, before)

    async def _wake(self) -> SleepAck:
        """Restore what the sleep freed and admit again. Awake already: done."""
        async with self._sleep_lock:
            before = self._held_now()
            if self.asleep is not None:
                try:
                    await self.engine.wake_up(self.asleep)
                except Exception as exc:
                    self._engine_failed(
                        f"waking from level {self.asleep} failed: {type(exc).__name__}: {exc}"
                    )
                    return self._ack(False, before, str(exc))
                self.core.sleeping, self.asleep = False, None
                log.info("stage %s/%s: awake", self.spec.name, self.replica)
                await self._publish_heartbeat()
            return self._ack(True, before)

    def _held_now(self) -> _Held:
        return _Held(time.monotonic(), self.metrics.resources.resident_bytes(), self.engine.weight_bytes())

    def _ack(self, ok: bool, before: _Held, message: str = "") -> SleepAck:
        freed = 0  # what left each device (weights moved to host memory left the accelerator)
        if before.weights is not None and (after := self.engine.weight_bytes()) is not None:
            freed = sum(max(0, n - after.get(device, 0)) for device, n in before.weights.items())
        return SleepAck(
            stage=self.spec.name,
            replica=self.replica,
            instance=self.instance,
            ok=ok,
            asleep=self.asleep,
            seconds=time.monotonic() - before.at,
            freed_bytes=freed,
            rss_bytes_before=before.rss,
            rss_bytes_after=self.metrics.resources.resident_bytes(),
            message=message,
        )

    def _engine_failed(self, why: str) -> None:
        """The engine is in no known state: fail what is held and exit, to be started afresh."""
        log.error("stage %s/%s: %s; restarting", self.spec.name, self.replica, why)
        self.engine_dead = why
        self._drained.set()
        self._stop.set()

    async def _follow_paused(self) -> None:
        """Sleep or wake when the stage's `paused` in the pipeline file changed (Kubernetes
        updates the mounted ConfigMap in place; nothing else in it applies before a restart)."""
        if self.pipeline_path is None or (stamp := _stamp(self.pipeline_path)) == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            paused = (
                (await asyncio.to_thread(load_pipeline, self.pipeline_path)).spec.stage(self.spec.name).paused
            )
        except (SpecError, KeyError) as exc:
            log.warning("stage %s: pipeline file changed, unreadable for now: %s", self.spec.name, exc)
            return
        if paused != self._paused:
            self._paused = paused
            log.info(
                "stage %s/%s: paused set %s in %s", self.spec.name, self.replica, paused, self.pipeline_path
            )
            self._spawn_control(self._sleep(self.engine.max_sleep_level, "wait") if paused else self._wake())

    # --- inbound -----------------------------------------------------------------------------

    async def _on_inbound(self, msg: Msg) -> None:
        try:
            m: Inbound | CreditMsg = unpack(msg.data, StageInbound)
            check_request_id(m.request_id if isinstance(m, CreditMsg) else m.ctx.request_id)
        except (wire.WireError, ConnectorError) as exc:
            log.warning("stage %s: refused a message on %s: %s", self.spec.name, msg.subject, exc)
            self.metrics.outcome("refused")
            return
        token = REQUEST_ID.set(m.request_id if isinstance(m, CreditMsg) else m.ctx.request_id)
        try:
            await self._take(msg, m)
        finally:
            REQUEST_ID.reset(token)

    async def _take(self, msg: Msg, m: Inbound | CreditMsg) -> None:
        if isinstance(m, CreditMsg):
            returned = self.ledger.returned(m.request_id, m.consumer, m.chunks)
            if returned and (held := self.requests.get(m.request_id)) is not None:
                held.credit_returned.set()
            return
        rid = m.ctx.request_id
        if self.core.is_aborted(rid):
            self._cleanup(rid)  # a late input of an aborted request: free its payload
            if isinstance(m, StageRequest):
                await self._answer(msg, Admitted(False, ErrorCode.ABORTED, f"request {rid} was aborted"))
            return
        st = self.requests.get(rid)
        if st is None:
            st, refusal = self._admit(m.ctx, msg.headers)
            self.metrics.admission(refusal.code if st is None else ("run" if st.task else "queued"))
            if st is None:
                if isinstance(m, StageRequest):
                    await self._answer(msg, refusal)
                else:  # an input for a request this replica never reserved, and cannot take now
                    await self._fail(m.ctx, refusal.message, refusal.code)
                self._cleanup(rid)
                return
        try:
            if isinstance(m, StageRequest):
                source = REQUEST_SOURCE in self.in_windows
                keys = self.engine.request_keys
                asked = m.sampling if source else {k: v for k, v in m.sampling.items() if k in keys}
                st.sampling = {**self.spec.sampling, **asked}
                await self._answer(msg, Admitted(True))
                if not source:
                    return  # a reservation: inputs come from upstream stages
                triggers = st.assembler.add(REQUEST_SOURCE, 0, m, 0, True)
            else:
                triggers = st.assembler.add(m.from_stage, m.sequence, m, m.units, m.is_last)
            for t in triggers:
                st.triggers.put_nowait(t)
        except (AssemblyError, asyncio.QueueFull) as exc:
            why = str(exc) or f"more than {self.max_triggers} inputs pending (past the edges' credit)"
            await self._fail(st.ctx, f"broken input stream: {why}", ErrorCode.INPUT_ERROR)
            self._abort(rid)

    async def _answer(self, msg: Msg, answer: Admitted) -> None:
        if msg.reply and self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, pack(answer))

    def _admit(
        self, ctx: RequestContext, carried: dict[str, str] | None
    ) -> tuple[_Request, None] | tuple[None, Admitted]:
        rid = ctx.request_id
        where = f"stage '{self.spec.name}' replica {self.replica}"
        if self.spec.name not in ctx.route:
            return None, Admitted(False, ErrorCode.BAD_ROUTE, f"{where} is not on the route of request {rid}")
        windows = {p: w for p, w in self.in_windows.items() if p == REQUEST_SOURCE or p in ctx.route}
        if not windows:  # nothing on the route feeds this stage: it would wait for ever
            inputs = ", ".join(self.in_windows)
            why = f"{where}: none of its inputs ({inputs}) is on the route of request {rid}"
            return None, Admitted(False, ErrorCode.BAD_ROUTE, why)
        if self.unhealthy:
            why = f"{where} is unhealthy: {self.unhealthy}"
            return None, Admitted(False, ErrorCode.UNHEALTHY, why, unhealthy=self.unhealthy)
        if (unread := self.ledger.unread_bytes) >= self.spec.max_unread_bytes:
            why = (
                f"{where} is full: {unread} bytes of its output wait unread by its consumers "
                f"(maxUnreadBytes {self.spec.max_unread_bytes})"
            )
            return None, Admitted(False, ErrorCode.FULL, why)
        if self.core.known(rid):  # ids are made unique by the gateway; never let one clash
            return None, Admitted(False, ErrorCode.DUPLICATE_REQUEST, f"{where} already holds request {rid}")
        admission = self.core.admit(rid)
        if admission is Admission.REJECT_DRAINING:
            return None, Admitted(False, ErrorCode.DRAINING, f"{where} is draining")
        if admission is Admission.REJECT_SLEEPING:
            return None, Admitted(False, ErrorCode.SLEEPING, f"{where} is asleep (level {self.asleep})")
        if admission is Admission.REJECT_FULL:
            return None, Admitted(False, ErrorCode.FULL, f"{where} is full")
        span = TRACER.start_span(
            "omni.stage.request",
            tracing.extract(carried),
            SpanKind.SERVER,
            {"omni.request_id": rid, "omni.stage": self.spec.name, "omni.replica": self.replica},
        )  # its parent: the gateway's span that sent the request (carried in the headers)
        st = _Request(ctx, InputAssembler(windows), asyncio.Queue(self.max_triggers), span)
        self.requests[rid] = st
        if admission is Admission.RUN:
            self._start(st)
        return st, None

    def _start_all(self, rids: list[str]) -> None:
        for rid in rids:
            if (st := self.requests.get(rid)) is not None:
                self._start(st)

    def _start(self, st: _Request) -> None:
        st.task = asyncio.get_running_loop().create_task(self._serve(st), name=f"req-{st.ctx.request_id}")
        # A done callback, not a finally: an abort may cancel the task before it ever ran, and
        # then no line of `_serve` runs at all.
        st.task.add_done_callback(lambda task: self._finished(st, task))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            m: AbortMsg = unpack(msg.data, AbortMsg)
            check_request_id(m.request_id)
        except (wire.WireError, ConnectorError) as exc:
            log.warning("stage %s: refused an abort: %s", self.spec.name, exc)
            return
        if self.core.known(m.request_id):
            log.info("stage %s: abort %s (%s)", self.spec.name, m.request_id, m.reason)
        self._abort(m.request_id)

    def _abort(self, rid: str) -> None:
        was_running = self.core.abort(rid)
        st = self.requests.get(rid)
        if was_running and st is not None and st.task is not None:
            st.task.cancel()  # its finally frees the request
            return
        if st is not None:  # queued, never started
            self.requests.pop(rid, None)
            self.metrics.outcome("aborted")
            st.span.set_attribute("omni.outcome", "aborted")
            st.span.end()
        self._cleanup(rid)
        self._check_idle()

    # --- one request -------------------------------------------------------------------------

    async def _serve(self, st: _Request) -> str:
        """Run one request to its end; returns its outcome (`_finished` frees what it held)."""
        rid = st.ctx.request_id
        REQUEST_ID.set(rid)  # this task's own context: its log lines name the request
        tracing.adopt(st.span)  # and its trace, and parent its spans
        TRACER.start_span("omni.stage.queue", start_time=st.admitted_ns).end()
        t0 = time.monotonic()
        seg = Segmenter(self.spec.max_segment_units, self.spec.flush_interval_ms / 1000)
        windows = {e.consumer: WindowState(e.window) for e in self.out_edges if e.consumer in st.ctx.route}
        self.ledger.open(rid, st.ctx.deadline, list(windows))
        engine_state: dict[str, Any] = {}
        emitted = _Emitted()
        try:
            async with asyncio.timeout(max(0.0, st.ctx.deadline - time.time())):
                ended = False
                while not ended:
                    trig = await st.triggers.get()
                    ended = trig.is_last
                    if trig.inputs or (ended and self.engine.needs_last_call):
                        self.metrics.window_triggers.inc()
                        inputs = self._fetch(st, trig)
                        await self._return_credit(st, trig)
                        call = EngineCall(rid, inputs, ended, st.sampling, engine_state)
                        with tracing.span("omni.engine.call", attributes=_call_attrs(trig)):
                            async for out in self.engine.generate(call):
                                if (s := seg.add(out)) is not None:
                                    await self._emit(st, s, windows, emitted, t0, _usage(engine_state, seg))
                        # Inputs read zero-copy pin their segments: let go before the next window.
                        del inputs, call
                last = seg.finish()
                usage = _usage(engine_state, seg)
                finish = last.finish_reason or engine_state.get("finish_reason") or "stop"
                await self._emit(st, last, windows, emitted, t0, usage, finish)
                self.ledger.close(rid)
                if self.spec.final_output is None and self.nc is not None:
                    done = StageDone(rid, self.spec.name, self.replica, usage)
                    await self.nc.publish(st.ctx.reply_to, pack(done))
            self.metrics.latency.observe(time.monotonic() - t0, exemplar={"request_id": rid})
            return "ok"
        except asyncio.CancelledError:
            return "aborted"  # (or shutting down)
        except TimeoutError:
            message = f"stage '{self.spec.name}': request deadline exceeded"
            await self._fail(st.ctx, message, ErrorCode.DEADLINE_EXCEEDED)
            return "timeout"
        except InvalidRequest as exc:  # the client asked for what this stage cannot do
            await self._fail(st.ctx, f"stage '{self.spec.name}': {exc}", ErrorCode.INVALID_REQUEST)
            return "invalid"
        except ConnectorError as exc:  # its message names the connector and what it said
            log.warning("stage %s: request %s: %s", self.spec.name, rid, exc)
            code = ErrorCode.PAYLOAD_GONE if isinstance(exc, PayloadGone) else ErrorCode.CONNECTOR_ERROR
            await self._fail(st.ctx, f"stage '{self.spec.name}': {exc}", code)
            return "error"
        except Exception as exc:
            log.exception("stage %s: request %s failed", self.spec.name, rid)
            await self._fail(
                st.ctx, f"stage '{self.spec.name}': {type(exc).__name__}: {exc}", ErrorCode.STAGE_ERROR
            )
            return "error"
        finally:
            engine_state.clear()

    def _finished(self, st: _Request, task: asyncio.Task[str]) -> None:
        """A request's task ended, whether or not it ever ran: free what the request held."""
        rid = st.ctx.request_id
        outcome = "aborted" if task.cancelled() else ("error" if task.exception() else task.result())
        st.span.set_attribute("omni.outcome", outcome)
        if outcome not in ("ok", "aborted"):
            st.span.set_status(StatusCode.ERROR, outcome)
        with tracing.within(st.span):  # the line names its trace
            log.info("stage %s/%s: request %s %s", self.spec.name, self.replica, rid, outcome)
        if outcome != "ok":
            self.core.abort(rid)
            self._cleanup(rid)
        self.metrics.outcome(outcome)
        self.requests.pop(rid, None)
        self._start_all(self.core.release(rid))
        self._check_idle()

    def _fetch(self, st: _Request, trig: Trigger[Inbound]) -> dict[str, dict[str, Any]]:
        """Read each producer's payload through its edge's connector and run the edge processor."""
        inputs: dict[str, dict[str, Any]] = {}
        for producer, m in trig.inputs.items():
            if isinstance(m, StageRequest):
                inputs[producer] = self._client_inputs(st, producer, m)
                continue
            payload = self._get(st, producer, m.handle)
            if (proc := self.processors.get(producer)) is not None:
                payload = proc(payload)
            inputs[producer] = payload
        return inputs

    async def _return_credit(self, st: _Request, trig: Trigger[Inbound]) -> None:
        """A chunk read is a chunk of credit back to its producer's replica."""
        assert self.nc is not None
        rid = st.ctx.request_id
        for producer, m in trig.inputs.items():
            if isinstance(m, SegmentMsg):
                credit = pack(CreditMsg(rid, self.spec.name))
                await self.nc.publish(self.subjects.stage_inbox(producer, st.ctx.route[producer]), credit)

    async def _wait_for_credit(self, st: _Request, consumer: str) -> None:
        """Pause the request (between engine steps: the engine's generator waits on us) until its
        consumer has read enough to take another chunk; its slot goes to a queued request."""
        rid = st.ctx.request_id
        if self.ledger.available(rid, consumer) > 0:
            return
        t = time.monotonic()
        self._start_all(self.core.pause(rid))
        try:
            with tracing.span("omni.credit.wait", attributes={"omni.consumer": consumer}):
                while self.ledger.available(rid, consumer) <= 0:
                    st.credit_returned.clear()
                    await st.credit_returned.wait()
        finally:
            self.core.resume(rid)
            self.metrics.credit_wait(consumer, time.monotonic() - t)

    def _client_inputs(self, st: _Request, producer: str, m: StageRequest) -> dict[str, Any]:
        """The client's inputs (and media tensors, under `media`, if it sent any)."""
        if m.payload is None:
            return dict(m.inputs)
        payload = self._get(st, producer, m.payload)
        if not (isinstance(payload, dict) and isinstance(payload.get("inputs"), dict)):
            raise ConnectorError(f"the request's payload is a {type(payload).__name__}, not its inputs")
        media = payload.get("media") or {}
        return {**payload["inputs"], **({"media": media} if media else {})}

    def _get(self, st: _Request, producer: str, handle: ConnectorHandle) -> Any:
        conn = self.in_connectors[producer]
        with tracing.span("omni.connector.get", attributes=_edge(conn, producer)) as span:
            t = time.perf_counter()
            payload, nbytes = conn.get(producer, self.spec.name, st.ctx.request_id, handle)
            self.metrics.connector(conn.name, "get", producer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return payload

    async def _emit(
        self,
        st: _Request,
        seg: Segment,
        windows: dict[str, WindowState],
        emitted: _Emitted,
        t0: float,
        usage: dict[str, int],
        finish: str | None = None,
    ) -> None:
        ctx = st.ctx
        now = time.monotonic()
        self.metrics.segments.inc()
        if emitted.last_at is None:
            self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.time_per_segment.observe(now - emitted.last_at)
        emitted.last_at = now
        assert self.nc is not None
        for edge in self.out_edges:
            ws = windows.get(edge.consumer)
            if ws is None:
                continue
            for chunk in ws.push(seg.data, seg.units, seg.is_last):
                charged = is_read(edge.window, chunk.units)
                if charged:
                    await self._wait_for_credit(st, edge.consumer)
                seq = emitted.next(edge.consumer)
                nbytes, handle = self._put(edge.connector, edge.consumer, ctx, chunk.payload, seq)
                if charged:
                    self.ledger.sent(ctx.request_id, edge.consumer, nbytes)
                out = SegmentMsg(ctx, self.spec.name, seq, chunk.is_last, chunk.units, handle)
                await self.nc.publish(
                    self.subjects.stage_inbox(edge.consumer, ctx.route[edge.consumer]), pack(out)
                )
        if self.spec.final_output is not None:
            await self.nc.publish(ctx.reply_to, pack(self._final(ctx, seg, usage, finish)))

    def _final(
        self, ctx: RequestContext, seg: Segment, usage: dict[str, int], finish: str | None
    ) -> FinalMsg:
        """The client-facing message for a segment, with the usage so far; the last one carries
        the finish reason."""
        kind = self.spec.final_output
        assert kind is not None
        handle = None
        if kind is not OutputKind.TEXT and seg.data:
            _, handle = self._put(self.final_connector, "gateway", ctx, seg.data, seg.sequence)
        return FinalMsg(
            request_id=ctx.request_id,
            stage=self.spec.name,
            replica=self.replica,
            kind=kind.value,
            sequence=seg.sequence,
            is_last=seg.is_last,
            text=seg.text,
            handle=handle,
            finish_reason=finish,
            usage=usage,
            logprobs=seg.logprobs or None,
            tool_calls=seg.tool_calls or None,
        )

    def _put(
        self, conn: OmniConnector, consumer: str, ctx: RequestContext, data: Any, seq: int
    ) -> tuple[int, ConnectorHandle]:
        with tracing.span("omni.connector.put", attributes=_edge(conn, consumer)) as span:
            t = time.perf_counter()
            _, nbytes, handle = conn.put(self.spec.name, consumer, ctx.request_id, data, seq=seq)
            self.metrics.connector(conn.name, "put", consumer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return nbytes, handle

    async def _fail(self, ctx: RequestContext, message: str, code: str) -> None:
        if self.nc is None:
            return
        err = ErrorMsg(ctx.request_id, self.spec.name, self.replica, message, code)
        with contextlib.suppress(Exception):
            await self.nc.publish(ctx.reply_to, pack(err))

    def _cleanup(self, rid: str) -> None:
        self.ledger.forget(rid)
        for c in self.connectors.values():
            try:
                c.cleanup(rid)
            except Exception:
                log.exception("stage %s: cleanup of %s in connector %s failed", self.spec.name, rid, c.name)

    def _check_idle(self) -> None:
        """After a request ended: wake what waits for the replica to hold nothing."""
        if self.core.has_work():
            return
        self._idle.set()
        if self.core.draining:
            self._drained.set()


def _usage(engine_state: dict[str, Any], seg: Segmenter) -> dict[str, int]:
    """What a request has read and made so far (the engine counts its prompt)."""
    return {"prompt_tokens": int(engine_state.get("prompt_tokens", 0)), "completion_tokens": seg.total_units}


def _call_attrs(trig: Trigger[Inbound]) -> dict[str, Any]:
    """What an engine call's span says of the window that triggered it."""
    return {"omni.inputs": sorted(trig.inputs), "omni.is_last": trig.is_last}


def _edge(conn: OmniConnector, peer: str) -> dict[str, str]:
    return {"omni.connector": conn.name, "omni.connector.kind": conn.kind, "omni.peer": peer}


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells a file's new content from its old: inode (Kubernetes swaps a ConfigMap's files
    by symlink), modification time, size."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@dataclass(frozen=True, slots=True)
class _Held:
    """What a replica held when a sleep or wake began (its ack reports the difference)."""

    at: float
    rss: int
    weights: dict[str, int] | None


class EngineDead(EngineError):
    """The replica's engine died or wedged while serving; the replica stopped for a restart."""


class _Emitted:
    """Per-request output bookkeeping: chunk sequence numbers per consumer, segment timing."""

    __slots__ = ("last_at", "seqs")

    def __init__(self) -> None:
        self.seqs: dict[str, int] = {}
        self.last_at: float | None = None

    def next(self, consumer: str) -> int:
        n = self.seqs.get(consumer, 0)
        self.seqs[consumer] = n + 1
        return n


def run_stage(
    ready: Callable[[dict[str, Any]], None],
    pipeline: PipelineFile,
    stage: str,
    replica: str,
    nats_url: str,
    metrics_host: str = "127.0.0.1",
    metrics_port: int = 0,
    pipeline_path: str | None = None,
) -> None:
    """Process entry point (used by `omni stage` and by `omni serve` through the lifecycle)."""
    configure_logging()
    setproctitle(f"omni: stage {stage} replica {replica}")
    configure_tracing(
        f"omni-stage-{stage}",
        pipeline.spec.observability.otlp_endpoint,
        **{"service.namespace": pipeline.name, "omni.stage": stage, "omni.replica": replica},
    )

    async def main() -> None:
        worker = StageWorker(pipeline, stage, replica, nats_url, pipeline_path)
        await worker.run(ready, metrics_host, metrics_port)

    try:
        asyncio.run(main())
    except EngineDead as exc:
        # Its engine is dead or wedged; a thread of it may never return, and an interpreter's
        # exit would wait for it for ever: go now, to be restarted.
        log.error("%s", exc)
        shutdown_tracing()
        logging.shutdown()
        os._exit(1)
    finally:
        shutdown_tracing()
