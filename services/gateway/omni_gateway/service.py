"""The gateway's side of the pipeline: routing, submitting, and tracking the requests it owns.

Each gateway owns the requests it accepted: it picks a replica per needed stage, sends the
route with the request, and receives that request's final outputs and errors on its own NATS
inbox. Every request ends exactly once (done, failed, aborted) and its end frees what it
holds: the inflight entry, and, unless it completed, everything the stages hold for it
(an abort broadcast) and any payload addressed to this gateway.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import nats
import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode

from omni_gateway.errors import (
    BadRequest,
    OmniError,
    Overloaded,
    PayloadTooLarge,
    StageFailed,
    Timeout,
    Unavailable,
)
from omni_gateway.events import AudioChunk, Event, Finished, ImageProgress, OfChoice, TextDelta
from omni_gateway.replay import Delivered, Diverged
from omni_gateway.replicas import Replica, ReplicaTable
from omni_pipeline import tracing, wire
from omni_pipeline.connectors import (
    ConnectorError,
    OmniConnector,
    PayloadGone,
    build_connectors,
    reclaim_unread,
)
from omni_pipeline.control import (
    HEARTBEAT_INTERVAL_S,
    AbortMsg,
    Admitted,
    ErrorCode,
    ErrorMsg,
    FinalMsg,
    GatewayInbound,
    Heartbeat,
    RequestContext,
    StageDone,
    StageRequest,
    Subjects,
    close_nats,
    connect_nats,
    pack,
    unpack,
)
from omni_pipeline.spec import REQUEST_SOURCE, OutputKind, PipelineFile
from omni_pipeline.tracing import TRACER

log = logging.getLogger("omni.gateway")

ADMIT_TIMEOUT_S: Final = 5.0
"""How long a replica may take to admit a request before it counts as lost."""
MIGRATABLE: Final = frozenset(
    {
        ErrorCode.REPLICA_LOST,
        ErrorCode.DRAINING,
        ErrorCode.FULL,
        ErrorCode.UNHEALTHY,
        ErrorCode.SLEEPING,
        ErrorCode.NATS_LOST,
    }
)
"""Errors that say where a request went, not what it is: a fresh route may well serve it (after
a NATS outage, the re-run waits for the server)."""
_ERRORS: Final[dict[str, type[OmniError]]] = {
    ErrorCode.NATS_LOST: Unavailable,
    ErrorCode.SLEEPING: Unavailable,
    ErrorCode.INVALID_REQUEST: BadRequest,
    ErrorCode.DEADLINE_EXCEEDED: Timeout,
}
"""Stage error codes that are not a stage's failure: the client's request, or our connection."""
ROOT_CAUSE_WAIT_S: Final = 2.0
"""How long a request that met a vanished payload waits for the error that explains it."""
RETRY_AFTER: Final = {"Retry-After": "1"}
EVENT_QUEUE: Final = 1024
"""Outputs one request may have waiting for its client; a client this far behind is dropped."""


@dataclass
class _Tracked:
    request_id: str
    route: dict[str, tuple[str, str]]
    """stage -> (replica id, instance), to notice when a replica we use dies."""
    final_stages: set[str]
    queue: asyncio.Queue[GatewayInbound] = field(default_factory=lambda: asyncio.Queue(EVENT_QUEUE))
    failed: ErrorMsg | None = None
    trace: Context | None = None
    """The attempt's span, as the parent of what is done for it."""
    stage_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage on the route, from its last message: what it read and made."""


class PipelineClient:
    def __init__(self, pipeline: PipelineFile, nats_url: str, gateway_id: str | None = None) -> None:
        self.pipeline = pipeline
        self.spec = pipeline.spec
        self.nats_url = nats_url
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.subjects = Subjects(pipeline.name)
        self.inbox = self.subjects.gateway_inbox(self.gateway_id)
        self.table = ReplicaTable(self.inbox)
        self.connectors: dict[str, OmniConnector] = build_connectors(self.spec, pipeline.name)
        self.inflight: dict[str, _Tracked] = {}
        self.nc: NatsClient | None = None
        self.covered = asyncio.Event()
        self.started_at = int(time.time())
        self._sweeper: asyncio.Task[None] | None = None
        self._ended_by_outage: set[str] = set()
        self._changed = asyncio.Event()
        self._waiting = 0
        """Requests waiting for a replica or for NATS (at most maxWaitingRequests)."""
        self.migrations: collections.Counter[str] = collections.Counter()
        """Re-runs on a fresh route: `moved` (nothing sent yet), `spliced` (a stream continued),
        `diverged` (a stream's re-run did not repeat it: failed)."""
        self._sources = {s.name: e.connector for s, e in self.spec.consumers(REQUEST_SOURCE)}
        """The stages that read the client's request, and the connector their media goes on."""
        self._without_media = {s.name for s, e in self.spec.consumers(REQUEST_SOURCE) if not e.media}
        """Those whose request edge says `media: false`: they get the messages alone."""

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Connect and subscribe; False if `stop` was set before NATS could be reached."""
        nc = await connect_nats(
            self.nats_url,
            f"gateway-{self.gateway_id}",
            stop=stop,
            on_disconnect=self._on_nats_lost,
            on_reconnect=self._on_nats_back,
        )
        if nc is None:
            return False
        self.nc = nc
        await self.nc.subscribe(self.inbox, cb=self._on_reply)
        await self.nc.subscribe(self.subjects.heartbeat, cb=self._on_heartbeat)
        self._sweeper = asyncio.get_running_loop().create_task(self._expire_replicas(), name="replica-expiry")
        return True

    async def stop(self) -> None:
        for rid in list(self.inflight):
            await self._end(rid, completed=False, reason="gateway shutting down")
        if self._sweeper:
            self._sweeper.cancel()
        if self.nc is not None:
            await close_nats(self.nc)
        for c in self.connectors.values():
            c.close()

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def ready(self) -> bool:
        return self.connected and self.table.covers([s.name for s in self.spec.stages if s.replicas > 0])

    # --- requests ----------------------------------------------------------------------------

    def accepted_parts(self, outputs: set[OutputKind]) -> frozenset[str] | None:
        """The content part kinds every source stage on these outputs' route reads; None while
        one of them has not declared its own."""
        return self._sources_declare(outputs, "accepts")

    def refuse_unhonoured(
        self, outputs: set[OutputKind], params: dict[str, Any], always: frozenset[str]
    ) -> None:
        """A 400 naming the first of `params` (beyond the `always` ones) that a source stage on
        these outputs' route does not declare it honours; none while one has not declared."""
        honoured = self._sources_declare(outputs, "honours")
        if honoured is None:
            return
        for name in sorted(set(params) - always - honoured):
            raise BadRequest(f"{name}: not honoured by this model's engine; leave it out", param=name)

    def voices(self) -> frozenset[str] | None:
        """The voices this pipeline speaks in: those every stage on the audio route that takes
        a voice speaks in (none: it takes no voice); None while one has not declared its own."""
        spoken: frozenset[str] | None = None
        for stage in self.spec.needed_stages({OutputKind.AUDIO}):
            if (own := self.table.declared(stage, "voices")) is None:
                return None
            if own:
                spoken = own if spoken is None else spoken & own
        return spoken or frozenset()

    def refuse_unknown_voice(self, voice: str | None, param: str) -> None:
        """A 400 listing the voices, for a voice this pipeline does not speak in; none while
        they are not all declared (the stages refuse it themselves then)."""
        if voice is None or (voices := self.voices()) is None:
            return
        if not voices:
            raise BadRequest(f"{param}: this model's audio takes no voice; leave it out", param=param)
        if voice not in voices:
            raise BadRequest(
                f"{param}: voice '{voice}' is not one of this model's voices: {', '.join(sorted(voices))}",
                param=param,
            )

    def _sources_declare(
        self, outputs: set[OutputKind], what: Literal["accepts", "honours"]
    ) -> frozenset[str] | None:
        declared: frozenset[str] | None = None
        for stage in self.spec.needed_stages(outputs):
            if stage not in self._sources:
                continue
            if what == "honours" and self.spec.stage(stage).skip_without_media:
                # Not its to decide: a request without media never reaches it (an encoder), and
                # the same field must not be honoured or refused by whether media came along.
                continue
            if (own := self.table.declared(stage, what)) is None:
                return None
            declared = own if declared is None else declared & own
        return declared

    async def generate(
        self,
        rid: str,
        inputs: dict[str, Any],
        sampling: dict[str, Any],
        outputs: set[OutputKind],
        media: dict[str, torch.Tensor] | None = None,
        *,
        whole: bool = False,
    ) -> AsyncIterator[Event]:
        """Run one request; yields its outputs as they arrive. Closing the iterator aborts it.
        `media`: the tensors the inputs' messages refer to, for the source stages.

        A request whose route loses a replica (dead, silent, restarted) or whose replica refuses
        it (draining, full, unhealthy) runs again on a fresh route, up to migrationLimit times,
        within its deadline; the old attempt is aborted and its payloads freed first. Nothing
        the caller has is sent twice: with `whole` (the caller sends nothing to its client
        before the end) the outputs are held until the request completes; otherwise a re-run's
        outputs are spliced on after what was already yielded (omni_gateway.replay), and a
        re-run that does not repeat it fails the request with the error that made it move.
        """
        deadline = time.monotonic() + self.spec.gateway.request_timeout_s
        limit = self.spec.gateway.migration_limit
        delivered = Delivered()
        moved_by: OmniError | None = None
        for attempt in range(limit + 1):
            held: list[Event] = []
            try:
                splice = delivered.splice() if delivered.anything else None
                arid = rid if attempt == 0 else f"{rid}-{attempt}"
                async with contextlib.aclosing(
                    self._attempt(arid, deadline, inputs, sampling, outputs, media)
                ) as events:
                    async for ev in events:
                        if splice is not None and (ev := splice(ev)) is None:
                            continue
                        if whole:
                            held.append(ev)
                            continue
                        delivered.record(ev)
                        yield ev
            except OmniError as exc:
                if exc.code not in MIGRATABLE or attempt == limit:
                    if exc.code == ErrorCode.FULL:
                        raise Overloaded(exc.message, headers=RETRY_AFTER) from None
                    raise
                moved_by = exc
                self.migrations["spliced" if delivered.anything else "moved"] += 1
                log.warning("gateway: request %s: %s; running it again on a fresh route", rid, exc.message)
                continue
            except Diverged as exc:
                assert moved_by is not None
                self.migrations["diverged"] += 1
                why = f"the stream cannot go on from a fresh route: {exc}"
                raise type(moved_by)(f"{moved_by.message}; {why}", code=moved_by.code) from None
            for ev in held:
                yield ev
            return

    async def generate_choices(
        self,
        rid: str,
        n: int,
        inputs: dict[str, Any],
        sampling: dict[str, Any],
        outputs: set[OutputKind],
        media: dict[str, torch.Tensor] | None = None,
        *,
        whole: bool = False,
    ) -> AsyncIterator[OfChoice]:
        """`n` replies to one request, as `n` requests side by side, their events interleaved as
        they come: vLLM's own parallel sampling is `n` child requests too, child `i` seeded
        with the request's seed plus `i` (unseeded children sample independently). Closing
        the iterator aborts them all; one failing fails the whole."""
        events: asyncio.Queue[tuple[int, Event | Exception | None]] = asyncio.Queue(EVENT_QUEUE)

        async def run(i: int) -> None:
            seeded = {**sampling, "seed": sampling["seed"] + i} if "seed" in sampling else sampling
            child = self.generate(f"{rid}.{i}", inputs, seeded, outputs, media, whole=whole)
            try:
                async for ev in child:
                    await events.put((i, ev))
                await events.put((i, None))
            except Exception as exc:
                await events.put((i, exc))
            finally:
                await child.aclose()  # aborts it, if it had not ended

        children = [
            asyncio.get_running_loop().create_task(run(i), name=f"choice-{rid}.{i}") for i in range(n)
        ]
        try:
            running = n
            while running:
                i, ev = await events.get()
                if ev is None:
                    running -= 1
                elif isinstance(ev, Exception):
                    raise ev
                else:
                    yield OfChoice(i, ev)
        finally:
            for child in children:
                child.cancel()
            await asyncio.gather(*children, return_exceptions=True)

    async def _attempt(
        self,
        rid: str,
        deadline: float,
        inputs: dict[str, Any],
        sampling: dict[str, Any],
        outputs: set[OutputKind],
        media: dict[str, torch.Tensor] | None,
    ) -> AsyncIterator[Event]:
        # Not made the current span: this generator yields, and a context attached here would
        # be detached in another (its caller's). What is done for the attempt names it as parent.
        span = TRACER.start_span("omni.request", attributes={"omni.request_id": rid})
        completed = False
        reason = "the client went away"
        try:
            needed = self.spec.needed_stages(outputs, media=bool(media))
            picked: dict[str, Replica] = {}
            try:
                for s in needed:
                    picked[s] = await self._pick(s, deadline)
            except OmniError as exc:
                self._release(picked)
                reason = exc.message
                raise
            assert self.nc is not None
            tracked = _Tracked(
                rid,
                {s: (r.hb.replica, r.hb.instance) for s, r in picked.items()},
                {s for s in needed if self.spec.stage(s).final_output in outputs},
                trace=trace.set_span_in_context(span),
            )
            for s, (replica, _) in tracked.route.items():
                span.set_attribute(f"omni.route.{s}", replica)
            remaining = deadline - time.monotonic()
            ctx = RequestContext(
                rid, {s: r[0] for s, r in tracked.route.items()}, self.inbox, time.time() + remaining
            )
            self.inflight[rid] = tracked
            try:
                # Downstream replicas first: each holds a slot before any source starts producing
                # for it, so a refusal (draining, full, gone) comes before any output.
                reservation = pack(StageRequest(ctx, {}, sampling))
                await self._reserve(tracked, {s: reservation for s in needed if s not in self._sources})
                sources = [s for s in needed if s in self._sources]
                payload = {"inputs": inputs, "media": media or {}}
                bare = {"inputs": inputs, "media": {}}  # for a stage that reads an encoder's outputs
                await self._reserve(
                    tracked,
                    {
                        s: self._for_source(s, ctx, sampling, bare if s in self._without_media else payload)
                        for s in sources
                    },
                )
                async with asyncio.timeout(remaining):
                    async for ev in self._events(tracked):
                        yield ev
                completed = True
            except TimeoutError:
                reason = "deadline exceeded"
                raise Timeout(f"request {rid} exceeded {self.spec.gateway.request_timeout_s:.0f}s") from None
            except OmniError as exc:
                reason = exc.message
                raise
            finally:
                await self._end(rid, completed, reason)
        finally:
            if not completed:
                span.set_status(StatusCode.ERROR, reason)
            span.end()

    async def _pick(self, stage: str, deadline: float) -> Replica:
        """A replica of `stage` for a new attempt. While NATS is away or the stage has no live
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
                    return self.table.pick(stage)
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

    def _release(self, picked: dict[str, Replica]) -> None:
        for stage, r in picked.items():
            self.table.release(stage, r.hb.instance)

    def _for_source(
        self, stage: str, ctx: RequestContext, sampling: dict[str, Any], payload: dict[str, Any]
    ) -> bytes:
        """A source stage's StageRequest, the client's inputs put on its request edge's connector
        (its own copy: a read frees it; inline in the handle when small). Once the request is
        in flight, so that its end frees the copy."""
        conn = self.connectors[self._sources[stage]]
        try:
            _, _, handle = conn.put(REQUEST_SOURCE, stage, ctx.request_id, payload)
        except wire.WireError as exc:  # what cannot travel is the client's error
            raise BadRequest(f"the request cannot be sent on: {exc}") from None
        except ConnectorError as exc:
            raise StageFailed(f"gateway -> stage '{stage}': {exc}", code=ErrorCode.CONNECTOR_ERROR) from None
        request = pack(StageRequest(ctx, {}, sampling, handle))
        if self.nc is not None and len(request) > self.nc.max_payload:
            raise PayloadTooLarge(
                f"the request is {len(request)} bytes as a NATS message, over the server's limit of "
                f"{self.nc.max_payload}: stage '{stage}' reads it through connector '{conn.name}' "
                f"({conn.kind}), which sends everything inline; a shm or mooncake connector carries any size"
            )
        return request

    async def _reserve(self, t: _Tracked, requests: dict[str, bytes]) -> None:
        """Send each stage's request to its replica and wait until every one has admitted it."""
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
                        self._replica_gone(gone, "is gone")  # fail what it still held, as expiry would
                    raise StageFailed(f"{where} is gone", code=ErrorCode.REPLICA_LOST) from None
                except (TimeoutError, nats.errors.TimeoutError):
                    raise StageFailed(
                        f"{where} did not answer in {ADMIT_TIMEOUT_S:.0f}s", code=ErrorCode.REPLICA_LOST
                    ) from None
                try:
                    answer: Admitted = unpack(reply.data, Admitted)
                except wire.WireError as exc:
                    raise StageFailed(f"{where} answered with an invalid message: {exc}") from None
                if not answer.ok:
                    self.table.refused(stage, instance, answer)
                    raise _ERRORS.get(answer.code, StageFailed)(answer.message, code=answer.code)

        await asyncio.gather(*(ask(s, r) for s, r in requests.items()))

    async def _events(self, t: _Tracked) -> AsyncIterator[Event]:
        pending = set(t.final_stages)
        expected: dict[str, int] = dict.fromkeys(t.final_stages, 0)
        held: dict[tuple[str, int], FinalMsg] = {}
        usage: dict[str, int] = {}
        finish = "stop"
        while pending:
            msg = await t.queue.get()
            if isinstance(msg, ErrorMsg):
                raise await self._root_cause(t, msg)
            if msg.stage not in pending:
                continue
            held[(msg.stage, msg.sequence)] = msg
            while (m := held.pop((msg.stage, expected[msg.stage]), None)) is not None:
                expected[msg.stage] += 1
                try:
                    events = self._final_events(t.request_id, m)
                except ConnectorError as exc:
                    code = (
                        ErrorCode.PAYLOAD_GONE if isinstance(exc, PayloadGone) else ErrorCode.CONNECTOR_ERROR
                    )
                    where = f"stage '{m.stage}' replica {m.replica} -> gateway"
                    raise await self._root_cause(
                        t, ErrorMsg(t.request_id, m.stage, m.replica, f"{where}: {exc}", code)
                    ) from None
                for ev in events:
                    yield ev
                if m.is_last:
                    pending.discard(m.stage)
                    if m.kind == OutputKind.TEXT:
                        usage.update(m.usage or {})
                        finish = m.finish_reason or finish
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        yield Finished(finish, usage, *self._media_usage(t))

    def _media_usage(self, t: _Tracked) -> tuple[int, int]:
        """(prompt tokens read on the route, units fed to its audio and image stages). Every
        stage's last message has come by now: it precedes, through the same NATS server, the
        outputs the final stages made from it."""
        prompt = sum(u.get("prompt_tokens", 0) for u in t.stage_usage.values())
        feeders = {
            e.from_
            for s in t.final_stages
            if self.spec.stage(s).final_output is not OutputKind.TEXT
            for e in self.spec.stage(s).inputs
        }
        fed = sum(t.stage_usage.get(p, {}).get("completion_tokens", 0) for p in feeders)
        return prompt, fed

    async def _root_cause(self, t: _Tracked, err: ErrorMsg) -> OmniError:
        """The error to answer `err` with. A payload that was gone is usually the echo of its
        producer's failure, which freed it after sending its own error: wait a moment for
        that error (the real cause) before blaming the missing payload. A stage's own error
        that a payload was gone still beats ours: it is a step nearer the cause (a Mooncake
        key lost with its master, say, which only the stage that read it can name)."""
        if err.code == ErrorCode.PAYLOAD_GONE:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ROOT_CAUSE_WAIT_S):
                    while True:  # outputs met on the way are freed when the request ends
                        m = await t.queue.get()
                        if isinstance(m, ErrorMsg):
                            err = m
                            if m.code != ErrorCode.PAYLOAD_GONE:
                                break
        return _ERRORS.get(err.code, StageFailed)(err.message, code=err.code)

    def _final_events(self, rid: str, m: FinalMsg) -> list[Event]:
        if m.kind == OutputKind.TEXT:
            if not (m.text or m.logprobs or m.tool_calls):
                return []
            return [TextDelta(m.text, m.logprobs or [], m.tool_calls or [], m.usage)]
        if m.handle is None:
            return []
        conn = self.connectors.get(m.handle.connector)
        if conn is None:
            raise StageFailed(f"stage '{m.stage}' sent a handle of unknown connector '{m.handle.connector}'")
        payload, _ = conn.get(m.stage, "gateway", rid, m.handle)
        if not isinstance(payload, dict):
            raise StageFailed(f"stage '{m.stage}' sent a {type(payload).__name__}, not a payload")
        if m.kind == OutputKind.AUDIO:
            audio = payload.get("audio")
            if not isinstance(audio, torch.Tensor):
                raise StageFailed(f"stage '{m.stage}' sent audio without samples")
            # A copy: the payload is a view on a shm segment, which a slow client must not pin.
            samples = audio.reshape(-1).float().numpy().copy()
            return [AudioChunk(samples, int(payload.get("sample_rate", 24000)))]
        if m.kind == OutputKind.IMAGE:
            return _image_events(m.stage, payload)
        raise StageFailed(f"stage '{m.stage}': output kind '{m.kind}' is not served by this endpoint")

    async def _end(self, rid: str, completed: bool, reason: str) -> None:
        t = self.inflight.pop(rid, None)
        if t is None:
            return
        for stage, (_, instance) in t.route.items():
            self.table.release(stage, instance)
        if completed:
            return
        if self.nc is not None and not self.nc.is_closed:  # while reconnecting, sent once back
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.abort, pack(AbortMsg(rid, reason)))
        self._free_payloads(rid)

    def _free_payloads(self, rid: str) -> None:
        for c in self.connectors.values():
            try:
                c.cleanup(rid)
            except Exception as exc:  # the backend's own expiry is the last owner then
                log.warning("gateway: cleanup of %s in connector %s failed: %s", rid, c.name, exc)

    def _fail(self, t: _Tracked, message: str, code: str) -> None:
        if t.failed is None:
            t.failed = ErrorMsg(t.request_id, "gateway", self.gateway_id, message, code)
            with contextlib.suppress(asyncio.QueueFull):
                t.queue.put_nowait(t.failed)

    # --- NATS callbacks ----------------------------------------------------------------------

    def _on_nats_lost(self) -> None:
        """Outputs sent while we are away are lost, so no request in flight can finish: end them
        now rather than at their deadline (their aborts go out once NATS is back)."""
        self._ended_by_outage.update(self.inflight)
        for t in list(self.inflight.values()):
            self._fail(
                t, "the gateway lost its connection to NATS while serving this request", ErrorCode.NATS_LOST
            )

    def _on_nats_back(self) -> None:
        """Free the requests the outage ended once more: a stage may have been writing a payload
        for one when we freed it first (a write in progress is not freed), and its message
        saying so was lost with the server."""
        self.table.heard_all(time.monotonic())
        self._table_changed()
        for rid in self._ended_by_outage:
            self._free_payloads(rid)
        self._ended_by_outage.clear()

    async def _on_reply(self, msg: Msg) -> None:
        try:
            m: FinalMsg | ErrorMsg | StageDone = unpack(msg.data, GatewayInbound)
        except wire.WireError as exc:
            log.warning("gateway: refused a message on its inbox: %s", exc)
            return
        t = self.inflight.get(m.request_id)
        part_done = isinstance(m, StageDone) or (isinstance(m, FinalMsg) and m.is_last)
        if t is not None and part_done and (done := t.route.pop(m.stage, None)) is not None:
            self.table.release(m.stage, done[1])  # and its loss no longer matters to the request
            if m.usage:
                t.stage_usage[m.stage] = dict(m.usage)
        if isinstance(m, StageDone):
            return
        if t is None:
            # A late output of a request that already ended: free its payload, if any.
            if isinstance(m, FinalMsg) and m.handle is not None:
                self._free_payloads(m.request_id)
            return
        try:
            t.queue.put_nowait(m)
        except asyncio.QueueFull:
            while not t.queue.empty():  # what the client will never read: drop it, free its payloads
                t.queue.get_nowait()
            self._free_payloads(m.request_id)
            self._fail(t, "the client is not reading its response fast enough", ErrorCode.CLIENT_TOO_SLOW)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb: Heartbeat = unpack(msg.data, Heartbeat)
        except wire.WireError as exc:
            log.warning("gateway: refused a heartbeat: %s", exc)
            return
        known = self.table.get(hb.stage, hb.instance) is not None
        for dead in self.table.update(hb, time.monotonic()):
            self._replica_gone(dead, "restarted")
        if (now_known := self.table.get(hb.stage, hb.instance) is not None) != known:
            log.info(
                "gateway: %s/%s (instance %s) %s",
                hb.stage,
                hb.replica,
                hb.instance,
                "joined" if now_known else "stopped",
            )
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
                self._replica_gone(r, "stopped sending heartbeats")
            await asyncio.to_thread(reclaim_unread, list(self.connectors.values()), self.spec)
            if not self.ready():
                self.covered.clear()

    def _replica_gone(self, r: Replica, why: str) -> None:
        stage, replica = r.hb.stage, r.hb.replica
        log.warning("gateway: %s/%s (instance %s) %s", stage, replica, r.hb.instance, why)
        for t in list(self.inflight.values()):
            if t.route.get(stage) == (replica, r.hb.instance):
                self._fail(
                    t,
                    f"stage '{stage}' replica {replica} {why} while serving this request",
                    ErrorCode.REPLICA_LOST,
                )


def _image_events(stage: str, payload: dict[str, Any]) -> list[Event]:
    """One event per unit: images [units, n, H, W, 3] uint8, with `step` and `final` per unit."""
    images, steps, final = payload.get("images"), payload.get("step"), payload.get("final")
    if not (
        isinstance(images, torch.Tensor)
        and isinstance(steps, torch.Tensor)
        and isinstance(final, torch.Tensor)
    ):
        raise StageFailed(f"stage '{stage}' sent an image without images, step and final")
    if images.dim() != 5 or images.dtype != torch.uint8 or images.shape[-1] != 3:
        raise StageFailed(f"stage '{stage}' sent images of shape {tuple(images.shape)} {images.dtype}")
    # Copies: the payload is a view on a shm segment, which a slow client must not pin.
    return [
        ImageProgress(int(steps[u]), [img.numpy().copy() for img in images[u]], bool(final[u]))
        for u in range(images.shape[0])
    ]
