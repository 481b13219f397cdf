"""The stage replica process: it wires the parts of a replica together and owns its NATS client.

The parts, each with one job: the request book (omni_stage.requests: admission, per-request
state, windows, credit; plain and synchronous), the runner (omni_stage.runner: one task per
running request), connector I/O off the loop (omni_stage.transfer), what the replica publishes
(omni_stage.outbox), heartbeats, health and readiness (omni_stage.beats), and sleep and wake
(omni_stage.sleep). `StageWorker` subscribes, hands each message to the part it is for, starts
and ends request tasks, and runs the process's lifecycle: start, drain on SIGTERM, stop.

One asyncio loop owns all state. The NATS callbacks only decode and hand messages on. A
request's end (done, failed, aborted, or cancelled before it ran) frees what it held in every
connector; a consumer frees a payload once it reads it and returns the producer its credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, Final

from nats.aio.msg import Msg
from setproctitle import setproctitle

from omni_pipeline import wire
from omni_pipeline.connection import close_nats, connect_nats
from omni_pipeline.connectors import ConnectorError, build_connectors, check_request_id
from omni_pipeline.control import (
    AbortMsg,
    Admitted,
    AudioInMsg,
    CreditMsg,
    ErrorCode,
    StageInbound,
    StageRequest,
    Subjects,
    unpack,
)
from omni_pipeline.lifecycle import exit_if_stuck, exit_process
from omni_pipeline.logs import REQUEST_ID, configure_logging
from omni_pipeline.placement import VISIBLE_DEVICES_ENV
from omni_pipeline.serving import listen, make_server, on_shutdown_signals
from omni_pipeline.spec import REQUEST_SOURCE, PipelineFile
from omni_pipeline.tracing import configure_tracing, shutdown_tracing
from omni_stage.assembly import AssemblyError
from omni_stage.beats import Beats
from omni_stage.commands import serve_commands
from omni_stage.engines.base import EngineError, import_object
from omni_stage.engines.registry import build_engine
from omni_stage.health import health_app
from omni_stage.metrics import StageMetrics
from omni_stage.outbox import Outbox
from omni_stage.requests import Inbound, OutEdge, RequestBook, RequestState
from omni_stage.runner import RequestRunner
from omni_stage.sleep import SleepControl
from omni_stage.state import Change, Phase, ReplicaState
from omni_stage.tasks import RequestTasks
from omni_stage.tokenize import serve_tokenize
from omni_stage.transfer import Transfers
from omni_stage.voice_clone import serve_cloning

log = logging.getLogger("omni.stage")

DRAIN_TIMEOUT_S: Final = 120.0


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
        self.spec = spec = pipeline.spec.stage(stage)
        self.replica = replica
        self.nats_url = nats_url
        self.name = f"{stage}/{replica}"
        instance = uuid.uuid4().hex[:12]
        self.subjects = Subjects(pipeline.name)
        self.inbox = self.subjects.stage_inbox(stage, replica)
        self.metrics = StageMetrics(stage, replica)
        self.connectors = build_connectors(pipeline.spec, pipeline.name)
        out_edges = [
            OutEdge(s.name, e.window, self.connectors[e.connector], e.credit, e.first_window)
            for s, e in pipeline.spec.consumers(stage)
        ]
        self.state = ReplicaState()
        """Its phase and health (omni_stage.state): changed here, by the sleep control and by
        the health checks; admission, readiness and the heartbeat read it."""
        self.book = RequestBook(spec, out_edges, f"stage '{stage}' replica {replica}", self.state)
        self.engine = build_engine(spec)
        self.outbox = Outbox(self.subjects, stage, replica)
        self.transfers = Transfers(stage, self.connectors, self.metrics)
        self.runner = RequestRunner(
            spec=spec, book=self.book, engine=self.engine, connectors=self.connectors,
            processors={e.from_: import_object(e.processor) for e in spec.inputs if e.processor},
            transfers=self.transfers, outbox=self.outbox, metrics=self.metrics, start=self._start_request,
        )  # fmt: skip
        self.tasks = RequestTasks(
            book=self.book, transfers=self.transfers, outbox=self.outbox, metrics=self.metrics,
            run=self.runner.run, on_idle=self._idle,
        )  # fmt: skip
        self.beats = Beats(
            book=self.book, engine=self.engine, outbox=self.outbox, transfers=self.transfers,
            metrics=self.metrics, subjects=self.subjects, instance=instance,
            used=self.runner.used_connectors(), pipeline=pipeline.spec,
        )  # fmt: skip
        self.sleep = SleepControl(
            book=self.book, engine=self.engine, outbox=self.outbox, metrics=self.metrics,
            instance=instance, pipeline_path=pipeline_path, paused=spec.paused,
            announce=self.beats.beat, abort=self.tasks.abort, engine_failed=self._engine_failed,
        )  # fmt: skip
        self._stop = asyncio.Event()
        self._drained = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(
        self, on_ready: Callable[[dict[str, Any]], None], metrics_host: str, metrics_port: int
    ) -> None:
        on_shutdown_signals(self.begin_drain)
        sock = listen(metrics_host, metrics_port)
        self.beats.metrics_port = port = sock.getsockname()[1]
        app = health_app(self.metrics.registry, self.beats.readiness, self.beats.refresh_gauges)
        server = make_server(app, lifespan="off")
        http = asyncio.create_task(server.serve(sockets=[sock]), name="health-http")
        devices = os.environ.get(VISIBLE_DEVICES_ENV, "unset")
        try:
            log.info(
                "stage %s: loading engine %s (%s=%s)",
                self.name,
                self.spec.engine.kind,
                VISIBLE_DEVICES_ENV,
                devices,
            )
            await self.engine.start()
            nc = await connect_nats(
                self.nats_url,
                f"stage-{self.spec.name}-{self.replica}",
                stop=self._stop,
                on_disconnect=self.tasks.end_all_for_outage,
                on_reconnect=self.tasks.free_again_after_outage,
            )
            if nc is None:
                log.info("stage %s: stopped before NATS was reachable", self.name)
                return
            self.outbox.nc = nc
            await nc.subscribe(self.inbox, cb=self._on_inbound)
            await nc.subscribe(self.subjects.abort, cb=self._on_abort)
            await serve_commands(nc, self.subjects, self.spec.name, self.engine, self.sleep)
            if self.book.is_source:
                await serve_tokenize(nc, self.subjects, self.spec.name, self.engine)
                read = self.runner.read_request
                await serve_cloning(nc, self.subjects, self.spec.name, self.engine, read, self.state)
            if self.sleep.paused:  # before it is ready: a paused stage's new replica starts asleep
                await self.sleep.sleep(self.engine.max_sleep_level, "wait")
            self.state.change(Change.SERVE)
            beating = asyncio.create_task(self.beats.beating(), name="heartbeat")
            checks = asyncio.create_task(self.beats.checking(self.sleep.follow_paused, self._engine_failed))
            await self.beats.beat()
            await nc.flush()
            on_ready({"stage": self.spec.name, "replica": self.replica, "metrics_port": port})
            log.info("stage %s ready (inbox %s, metrics :%d)", self.name, self.inbox, port)
            await self._stop.wait()
            if self.state.phase is not Phase.DEAD:
                await self._finish_drain()
            beating.cancel()
            checks.cancel()
            self.sleep.cancel()
            dead = self.state.dead
            await self._fail_held(
                "stopped before finishing this request" if dead is None else f"lost its engine ({dead})"
            )
            await self.beats.beat(stopping=True)
        finally:
            exit_if_stuck()  # done serving: closing must not hold the process (or a pod) for ever
            self.tasks.cancel_all()
            if self.outbox.nc is not None:
                await close_nats(self.outbox.nc)
            server.should_exit = True
            await http
            await self.engine.close()
            self.transfers.close()
        if self.state.phase is Phase.DEAD:  # a non-zero exit: the supervisor (or kubelet) restarts us
            raise EngineDead(f"stage {self.name}: {self.state.dead}")

    def begin_drain(self) -> None:
        """SIGTERM: take no new requests, finish the ones we have, then stop. Twice: stop now."""
        if self.state.phase in (Phase.DRAINING, Phase.DEAD):
            log.warning("stage %s: second signal, stopping now", self.name)
            self._drained.set()
            self._stop.set()
            return
        log.info("stage %s: draining %d requests", self.name, len(self.book.requests))
        self.state.change(Change.DRAIN)
        self._stop.set()
        if self.outbox.nc is not None:
            asyncio.get_running_loop().create_task(self.beats.beat())

    async def _finish_drain(self) -> None:
        if self.book.has_work():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    await self._drained.wait()

    def _engine_failed(self, why: str) -> None:
        """The engine is in no known state: fail what is held and exit, to be started afresh."""
        log.error("stage %s: %s; restarting", self.name, why)
        self.state.change(Change.DIE, why=why)
        self._drained.set()
        self._stop.set()

    async def _fail_held(self, why: str) -> None:
        """Before the stopping beat, on the same connection as every other message about them:
        a gateway learns each request's end from its own inbox, never from the beat."""
        held = [st.ctx for st in self.book.requests.values()]
        await self.outbox.fail_all(held, f"{self.book.where} {why}", ErrorCode.REPLICA_LOST)

    # --- inbound -----------------------------------------------------------------------------

    async def _on_inbound(self, msg: Msg) -> None:
        try:
            m: Inbound | CreditMsg | AudioInMsg = unpack(msg.data, StageInbound)
            if not isinstance(m, AudioInMsg):
                check_request_id(m.request_id if isinstance(m, CreditMsg) else m.ctx.request_id)
        except (wire.WireError, ConnectorError) as exc:
            log.warning("stage %s: refused a message on %s: %s", self.spec.name, msg.subject, exc)
            self.metrics.outcome("refused")
            return
        if isinstance(m, AudioInMsg):
            if self.engine.audio_ahead is not None:
                self.engine.audio_ahead.append(m.key, m.start, m.pcm, m.rate)
            return
        if isinstance(m, CreditMsg):
            self.book.credit_back(m.request_id, m.consumer, m.chunks)
            return
        token = REQUEST_ID.set(m.ctx.request_id)
        try:
            await self._take(msg, m)
        finally:
            REQUEST_ID.reset(token)

    async def _take(self, msg: Msg, m: Inbound) -> None:
        rid = m.ctx.request_id
        if self.book.is_aborted(rid):
            self._discard(m)  # a late input of an aborted request: free its payload
            if isinstance(m, StageRequest):
                await self.outbox.answer(
                    msg.reply, Admitted(False, ErrorCode.ABORTED, f"request {rid} was aborted")
                )
            return
        st = self.book.requests.get(rid)
        if st is None:
            admitted = self.tasks.admit(m.ctx, msg.headers)
            if isinstance(admitted, Admitted):
                if isinstance(m, StageRequest):
                    await self.outbox.answer(msg.reply, admitted)
                else:  # an input for a request this replica never reserved, and cannot take now
                    await self.outbox.fail(m.ctx, admitted.message, ErrorCode(admitted.code))
                self._discard(m)
                return
            st = admitted
        try:
            if isinstance(m, StageRequest):
                source = self.book.take_request(st, m, self.engine.request_keys)
                await self.outbox.answer(msg.reply, Admitted(True))
                if source:
                    self.book.add_input(st, REQUEST_SOURCE, 0, m, 0, True)
            else:
                self.book.add_input(st, m.from_stage, m.sequence, m, m.units, m.is_last)
        except (AssemblyError, asyncio.QueueFull) as exc:
            why = str(exc) or f"more than {self.book.max_triggers} inputs pending (past the edges' credit)"
            await self.outbox.fail(st.ctx, f"broken input stream: {why}", ErrorCode.INPUT_ERROR)
            self.tasks.abort(rid)

    def _discard(self, m: Inbound) -> None:
        """Free the payload of an input this replica will not read (its writer frees what it
        wrote once it hears the request ended, and the gateway what a dead writer left)."""
        handle = m.payload if isinstance(m, StageRequest) else m.handle
        if handle is not None:
            self.transfers.discard(m.ctx.request_id, handle)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            m: AbortMsg = unpack(msg.data, AbortMsg)
            check_request_id(m.request_id)
        except (wire.WireError, ConnectorError) as exc:
            log.warning("stage %s: refused an abort: %s", self.spec.name, exc)
            return
        if self.book.knows(m.request_id):
            log.info("stage %s: abort %s (%s)", self.spec.name, m.request_id, m.reason)
        self.tasks.abort(m.request_id)

    def _start_request(self, st: RequestState) -> None:
        """A queued request's turn came (a running one paused for credit): its task starts. The
        runner and the tasks need each other; the worker that owns both introduces them."""
        self.tasks.start(st)

    def _idle(self) -> None:
        """The replica holds nothing any more: wake a sleep or a drain waiting for that."""
        self.sleep.idle()
        if self.state.draining:
            self._drained.set()


class EngineDead(EngineError):
    """The replica's engine died or wedged while serving; the replica stopped for a restart."""


def run_at_niceness(nice: int) -> None:
    """Every thread of this process at (at least) `nice`, before the engine starts more: Linux
    keeps a niceness per thread, which a new thread or process takes from the one starting it."""
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in map(int, threads):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)


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
    run_at_niceness(pipeline.spec.stage(stage).nice)
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
        exit_process(1)
    finally:
        shutdown_tracing()
