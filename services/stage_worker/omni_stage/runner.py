"""One request's run at a replica: take its triggers, read its inputs, call the engine, send on.

Each running request is one task over `RequestRunner.run`. It reads each trigger's payloads
through their edges' connectors (off the loop), returns their credit, calls the engine, cuts its
output into segments, and sends each segment where the request's windows say: a chunk per
consumer (waiting for credit first when the edge has none left), and the client's outputs to
its gateway. Its outcome is a word (`ok`, `aborted`, `timeout`, ...); whoever started the task
frees what the request held when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from omni_pipeline import tracing
from omni_pipeline.connectors import ConnectorError, ConnectorHandle, OmniConnector
from omni_pipeline.control import (
    ErrorCode,
    FinalMsg,
    PromptLogprobs,
    RequestPayload,
    SegmentMsg,
    StageDone,
    StageRequest,
    connector_error_code,
)
from omni_pipeline.logs import REQUEST_ID
from omni_pipeline.spec import DEFAULT_CONNECTOR, REQUEST_SOURCE, OutputKind, StageSpec
from omni_pipeline.tracing import TRACER
from omni_stage.assembly import Trigger
from omni_stage.engines.base import CallState, Engine, EngineCall, InvalidRequest
from omni_stage.engines.batching import STEP_PRIORITY
from omni_stage.metrics import StageMetrics
from omni_stage.outbox import Outbox
from omni_stage.requests import Inbound, RequestBook, RequestState, Send
from omni_stage.segments import Segment, Segmenter
from omni_stage.transfer import Transfers

log = logging.getLogger("omni.stage")

Processor = Callable[[dict[str, Any]], dict[str, Any]]


class RequestRunner:
    """Runs requests to their end at one replica."""

    def __init__(
        self,
        *,
        spec: StageSpec,
        book: RequestBook,
        engine: Engine,
        connectors: dict[str, OmniConnector],
        processors: dict[str, Processor],
        transfers: Transfers,
        outbox: Outbox,
        metrics: StageMetrics,
        start: Callable[[RequestState], None],
    ) -> None:
        self.spec = spec
        self.book = book
        self.engine = engine
        self.in_connectors = {e.from_: connectors[e.connector] for e in spec.inputs}
        self.final_connector = connectors[DEFAULT_CONNECTOR]
        self.processors = processors
        self.transfers = transfers
        self.outbox = outbox
        self.metrics = metrics
        self.start = start
        """Start a queued request's task (one whose slot a paused request gave up)."""
        firsts = [e.first_window for e in book.out_edges if e.first_window is not None]
        if spec.final_output is OutputKind.AUDIO:
            firsts.append(1)  # the client's first audio: out as soon as it is made
        self.first_units = min(firsts, default=None)
        """The units that flush a request's first segment, where fewer than `maxSegmentUnits`
        are awaited: an out-edge's first window, or (a stage whose output is audio) one."""

    def used_connectors(self) -> set[OmniConnector]:
        """The connectors this stage reads or writes through (every process builds them all)."""
        outs = (e.connector for e in self.book.out_edges)
        return {*self.in_connectors.values(), *outs, self.final_connector}

    async def run(self, st: RequestState) -> str:
        """Run one request to its end; returns its outcome."""
        rid = st.request_id
        REQUEST_ID.set(rid)  # this task's own context: its log lines name the request
        STEP_PRIORITY.set(st.ctx.priority)  # and its engine steps take its priority
        tracing.adopt(st.span)  # and its trace, and parent its spans
        TRACER.start_span("omni.stage.queue", start_time=st.admitted_ns).end()
        self.metrics.queue_wait.observe(max(0.0, (time.time_ns() - st.admitted_ns) / 1e9))
        t0 = time.monotonic()
        seg = Segmenter(
            self.spec.max_segment_units, self.spec.flush_interval_ms / 1000, first_units=self.first_units
        )
        self.book.start(st)
        engine_state = CallState()
        name = self.spec.name
        try:
            async with asyncio.timeout(max(0.0, st.ctx.deadline - time.time())):
                ended = False
                while not ended:
                    trig = await st.triggers.get()
                    ended = trig.is_last
                    if trig.inputs or (ended and self.engine.needs_last_call):
                        self.metrics.window_triggers.inc()
                        inputs = await self._fetch(st, trig)
                        call: EngineCall | None = None
                        try:
                            await self._return_credit(st, trig)
                            call = EngineCall(rid, inputs, ended, st.sampling, engine_state, st.ctx.priority)
                            called = time.monotonic()
                            with tracing.span("omni.engine.call", attributes=_call_attrs(trig)):
                                async with contextlib.aclosing(self.engine.generate(call)) as outs:
                                    async for out in outs:
                                        if (s := seg.add(out)) is not None:
                                            await self._emit(st, s, t0, _usage(engine_state, seg))
                            self.metrics.engine_call.observe(time.monotonic() - called)
                        finally:
                            # Inputs read zero-copy pin their segments: let go before the next
                            # window, and at once when an error leaves it (its traceback holds
                            # this frame, and a reference cycle would keep the inputs, and the
                            # segments, until the cyclic collector happened to run).
                            del inputs, call
                last = seg.finish()
                usage = _usage(engine_state, seg)
                finish = last.finish_reason or engine_state.finish_reason or "stop"
                await self._emit(st, last, t0, usage, finish, engine_state.prompt_logprobs)
                self.book.sent_all(st)
                if self.spec.final_output is None and self.outbox.nc is not None:
                    await self.outbox.final(st.ctx, StageDone(rid, name, self.outbox.replica, usage))
            self.metrics.latency.observe(time.monotonic() - t0, exemplar={"request_id": rid})
            return "ok"
        except asyncio.CancelledError:
            return "aborted"  # (or shutting down)
        except TimeoutError:
            await self.outbox.fail(
                st.ctx, f"stage '{name}': request deadline exceeded", ErrorCode.DEADLINE_EXCEEDED
            )
            return "timeout"
        except InvalidRequest as exc:  # the client asked for what this stage cannot do
            await self.outbox.fail(st.ctx, f"stage '{name}': {exc}", ErrorCode.INVALID_REQUEST)
            return "invalid"
        except ConnectorError as exc:  # its message names the connector and what it said
            log.warning("stage %s: request %s: %s", name, rid, exc)
            await self.outbox.fail(st.ctx, f"stage '{name}': {exc}", connector_error_code(exc))
            return "error"
        except Exception as exc:
            log.exception("stage %s: request %s failed", name, rid)
            why = f"stage '{name}': {type(exc).__name__}: {exc}"
            await self.outbox.fail(st.ctx, why, ErrorCode.STAGE_ERROR)
            return "error"
        finally:
            self.engine.request_ended(engine_state)  # (a slot of its cache given back)
            engine_state.engine = None  # a KV cache is freed now, not when the task is collected

    # --- in ----------------------------------------------------------------------------------

    async def _fetch(self, st: RequestState, trig: Trigger[Inbound]) -> dict[str, dict[str, Any]]:
        """Read each producer's payload through its edge's connector and run the edge processor."""
        inputs: dict[str, dict[str, Any]] = {}
        for producer, m in trig.inputs.items():
            if isinstance(m, StageRequest):
                inputs[producer] = await self._client_inputs(st, producer, m)
                continue
            payload = await self.transfers.receive(
                self.in_connectors[producer], producer, st.request_id, m.handle
            )
            if (proc := self.processors.get(producer)) is not None:  # model glue: tensor work, off the loop
                payload = await asyncio.to_thread(proc, payload)
            inputs[producer] = payload
        return inputs

    async def _client_inputs(self, st: RequestState, producer: str, m: StageRequest) -> dict[str, Any]:
        """The client's inputs (and media tensors, under `media`, if it sent any)."""
        if m.payload is None:
            return m.inputs.as_dict() if m.inputs is not None else {}
        return await self.read_request(st.request_id, m.payload, producer)

    async def read_request(
        self, request_id: str, handle: ConnectorHandle, producer: str = REQUEST_SOURCE
    ) -> dict[str, Any]:
        """A RequestPayload the gateway put on this stage's request edge, as an engine reads it
        (read once: the read frees it)."""
        payload = await self.transfers.receive(self.in_connectors[producer], producer, request_id, handle)
        try:
            request = msgspec.convert(payload, RequestPayload)
        except msgspec.ValidationError as exc:
            raise ConnectorError(f"the request's payload is not a request: {exc}") from None
        if request.inputs.images and "image" not in self.engine.accepts:
            raise InvalidRequest("image: this model does not edit images; it makes them from a prompt alone")
        return {**request.inputs.as_dict(), **({"media": request.media} if request.media else {})}

    async def _return_credit(self, st: RequestState, trig: Trigger[Inbound]) -> None:
        """A chunk read is a chunk of credit back to its producer's replica."""
        for producer, m in trig.inputs.items():
            if isinstance(m, SegmentMsg):
                await self.outbox.credit(st.ctx, producer)

    # --- out ---------------------------------------------------------------------------------

    async def _emit(
        self,
        st: RequestState,
        seg: Segment,
        t0: float,
        usage: dict[str, int],
        finish: str | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> None:
        now = time.monotonic()
        self.metrics.segments.inc()
        if st.last_emit_at is None:
            self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.time_per_segment.observe(now - st.last_emit_at)
        st.last_emit_at = now
        ctx = st.ctx
        for send in await self._plan(st, seg):
            if send.charged:
                await self._wait_for_credit(st, send.edge.consumer)
            conn = send.edge.connector
            nbytes, handle = await self.transfers.send(
                conn, send.edge.consumer, ctx.request_id, send.chunk.payload, send.sequence
            )
            self.book.sent(st, send, nbytes)
            out = SegmentMsg(ctx, self.spec.name, send.sequence, send.chunk.is_last, send.chunk.units, handle)
            await self.outbox.segment(send.edge.consumer, out)
        if self.spec.final_output is not None:
            await self.outbox.final(ctx, await self._final(st, seg, usage, finish, prompt))

    async def _wait_for_credit(self, st: RequestState, consumer: str) -> None:
        """Pause the request (between engine steps: the engine's generator waits on us) until its
        consumer has read enough to take another chunk; its slot goes to a queued request."""
        if self.book.credit(st, consumer) > 0:
            return
        t = time.monotonic()
        for queued in self.book.pause(st):
            self.start(queued)
        try:
            with tracing.span("omni.credit.wait", attributes={"omni.consumer": consumer}):
                while self.book.credit(st, consumer) <= 0:
                    st.credit_returned.clear()
                    await st.credit_returned.wait()
        finally:
            self.book.resume(st)
            self.metrics.credit_wait(consumer, time.monotonic() - t)

    async def _plan(self, st: RequestState, seg: Segment) -> list[Send]:
        """The segment's sends on each out-edge (RequestBook.plan), its payload joined for them
        and for the gateway: off the loop where that copies tensors (outputs joined, an edge's
        window of them cut)."""

        def joined_and_planned() -> list[Send]:
            _ = seg.data
            return self.book.plan(st, seg)

        if seg.parts and (len(seg.parts) > 1 or st.windows):
            return await asyncio.to_thread(joined_and_planned)
        return joined_and_planned()

    async def _final(
        self,
        st: RequestState,
        seg: Segment,
        usage: dict[str, int],
        finish: str | None,
        prompt: PromptLogprobs | None,
    ) -> FinalMsg:
        """The client-facing message for a segment, with the usage so far; the last one carries
        the finish reason."""
        kind = self.spec.final_output
        assert kind is not None
        handle = None
        if kind is not OutputKind.TEXT and seg.data:
            conn = self.final_connector
            _, handle = await self.transfers.send(conn, "gateway", st.request_id, seg.data, seg.sequence)
        return FinalMsg(
            request_id=st.request_id,
            stage=self.spec.name,
            replica=self.outbox.replica,
            kind=kind.value,
            sequence=seg.sequence,
            is_last=seg.is_last,
            text=seg.text,
            handle=handle,
            finish_reason=finish,
            usage=usage,
            logprobs=seg.logprobs or None,
            prompt_logprobs=prompt if kind is OutputKind.TEXT else None,
            tool_calls=seg.tool_calls or None,
        )


def _usage(engine_state: CallState, seg: Segmenter) -> dict[str, int]:
    """What a request has read and made so far (the engine counts its prompt)."""
    usage = {"prompt_tokens": engine_state.prompt_tokens, "completion_tokens": seg.total_units}
    return usage | ({"cached_tokens": engine_state.cached_tokens} if engine_state.cached_tokens else {})


def _call_attrs(trig: Trigger[Inbound]) -> dict[str, Any]:
    """What an engine call's span says of the window that triggered it."""
    return {"omni.inputs": sorted(trig.inputs), "omni.is_last": trig.is_last}
