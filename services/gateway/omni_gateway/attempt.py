"""One attempt of a request: a route picked, every stage on it reserved, the outputs in order.

A replica per needed stage is picked; the downstream stages are reserved first (each holds a
slot before any source produces for it, so a refusal comes before any output), then the
source stages get the client's request, their copy on their request edge's connector. The
final stages' outputs are put back in order per stage and turned into events; the attempt
ends with the usage. However it ends, `Inflight.end` frees what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

import torch
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from omni_gateway.bus import ERRORS, Bus
from omni_gateway.errors import BadRequest, OmniError, StageFailed, Timeout
from omni_gateway.events import (
    AudioChunk,
    Event,
    Finished,
    ImageProgress,
    StageFigures,
    TextDelta,
    VideoProgress,
)
from omni_gateway.inflight import Tracked
from omni_gateway.pins import ConversationPins
from omni_gateway.replicas import Replica
from omni_gateway.request import BATCH_PRIORITY, ON_ROUTED, Prepared
from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorError
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import (
    ErrorCode,
    ErrorMsg,
    FinalMsg,
    RequestContext,
    RequestPayload,
    StageRequest,
    connector_error_code,
    pack,
)
from omni_pipeline.payloads import Audio, Images, VideoFrames
from omni_pipeline.sampling import EMPTY
from omni_pipeline.spec import REQUEST_SOURCE, OutputKind, PipelineSpec
from omni_pipeline.tracing import TRACER

ROOT_CAUSE_WAIT_S: Final = 2.0
"""How long a request that met a vanished payload waits for the error that explains it."""


class Attempts:
    """Runs attempts of requests through the pipeline."""

    def __init__(self, spec: PipelineSpec, bus: Bus, payloads: OffLoop, *, pins: ConversationPins) -> None:
        self.spec = spec
        self.bus = bus
        self.payloads = payloads
        self.pins = pins
        """Where each conversation's requests last ran (they go back there while it has room)."""
        self.sources = {s.name: e.connector for s, e in spec.consumers(REQUEST_SOURCE)}
        """The stages that read the client's request, and the connector their copy goes on."""
        self.without_media = {s.name for s, e in spec.consumers(REQUEST_SOURCE) if not e.media}
        """Those whose request edge says `media: false`: they get the messages alone."""

    async def run(self, rid: str, deadline: float, req: Prepared) -> AsyncIterator[Event]:
        """One attempt; its events as they come. Closing it aborts the attempt."""
        # Not made the current span: this generator yields, and a context attached here would
        # be detached in another (its caller's). What is done for the attempt names it as parent.
        span = TRACER.start_span("omni.request", attributes={"omni.request_id": rid})
        completed = False
        reason = "the client went away"
        inflight = self.bus.inflight
        try:
            needed = self.spec.needed_stages(set(req.outputs), media=bool(req.media))
            picked: dict[str, Replica] = {}
            key = req.sampling.prompt_cache_key
            pinned = self.pins.route(key)
            try:
                for s in needed:
                    picked[s] = await self.bus.pick(s, deadline, pinned.get(s))
            except OmniError as exc:
                for stage, r in picked.items():
                    self.bus.table.release(stage, r.hb.instance)
                reason = exc.message
                raise
            if (routed := ON_ROUTED.get()) is not None:
                routed()
            if key is not None:
                self.pins.remember(key, {s: r.hb.instance for s, r in picked.items()})
            t = Tracked(
                rid,
                {s: (r.hb.replica, r.hb.instance) for s, r in picked.items()},
                {s for s in needed if self.spec.stage(s).final_output in req.outputs},
                trace=trace.set_span_in_context(span),
            )
            for s, (replica, _) in t.route.items():
                span.set_attribute(f"omni.route.{s}", replica)
            remaining = deadline - time.monotonic()
            ctx = RequestContext(
                rid,
                {s: r[0] for s, r in t.route.items()},
                self.bus.inbox,
                time.time() + remaining,
                req.priority + BATCH_PRIORITY.get(),
            )
            inflight.add(t)
            try:
                # Downstream replicas first: each holds a slot before any source starts producing
                # for it, so a refusal (draining, full, gone) comes before any output.
                await self.bus.reserve(
                    t,
                    {
                        s: pack(StageRequest(ctx, None, req.sampling, own=req.per_stage.get(s, EMPTY)))
                        for s in needed
                        if s not in self.sources
                    },
                )
                sources = [s for s in needed if s in self.sources]
                await self.bus.reserve(t, {s: await self._for_source(s, ctx, req) for s in sources})
                async with asyncio.timeout(remaining):
                    async for ev in self._events(t):
                        yield ev
                completed = True
            except TimeoutError:
                reason = "deadline exceeded"
                # Said as a stage's timer says it: whichever fires first, the client reads the same.
                limit = self.spec.gateway.request_timeout_s
                raise Timeout(f"request {rid}: request deadline exceeded ({limit:g}s)") from None
            except OmniError as exc:
                reason = exc.message
                raise
            finally:
                await inflight.end(rid, completed, reason)
        finally:
            if not completed:
                span.set_status(StatusCode.ERROR, reason)
            span.end()

    def with_media(self) -> list[str]:
        """The stages that read the client's request with its media."""
        return [s for s in self.sources if s not in self.without_media]

    async def _for_source(self, stage: str, ctx: RequestContext, req: Prepared) -> bytes:
        """A source stage's StageRequest, the client's request put on its request edge's
        connector (its own copy: a read frees it; inline in the handle when small). Once the
        attempt is in flight, so that its end frees the copy."""
        conn = self.payloads.connectors[self.sources[stage]]
        payload = RequestPayload(req.inputs, {} if stage in self.without_media else req.media)
        try:
            _, _, handle = await self.payloads.put(conn, REQUEST_SOURCE, stage, ctx.request_id, payload)
        except wire.WireError as exc:  # what cannot travel is the client's error
            raise BadRequest(f"the request cannot be sent on: {exc}") from None
        except ConnectorError as exc:
            raise StageFailed(f"gateway -> stage '{stage}': {exc}", code=ErrorCode.CONNECTOR_ERROR) from None
        request = pack(StageRequest(ctx, None, req.sampling, handle, own=req.per_stage.get(stage, EMPTY)))
        return self.bus.sized(
            request,
            f": stage '{stage}' reads it through connector '{conn.name}' ({conn.kind}), which sends "
            "everything inline; a shm or mooncake connector carries any size",
        )

    async def _events(self, t: Tracked) -> AsyncIterator[Event]:
        pending = set(t.final_stages)
        expected: dict[str, int] = dict.fromkeys(t.final_stages, 0)
        held: dict[tuple[str, int], FinalMsg] = {}
        usage: dict[str, int] = {}
        finish = "stop"
        prompt_logprobs = None
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
                    events = await self._final_events(t.request_id, m)
                except ConnectorError as exc:
                    where = f"stage '{m.stage}' replica {m.replica} -> gateway"
                    code = connector_error_code(exc)
                    err = ErrorMsg(t.request_id, m.stage, m.replica, f"{where}: {exc}", code)
                    raise await self._root_cause(t, err) from None
                for ev in events:
                    yield ev
                if m.is_last:
                    pending.discard(m.stage)
                    if m.kind == OutputKind.TEXT:
                        usage.update(m.usage or {})
                        finish = m.finish_reason or finish
                        prompt_logprobs = m.prompt_logprobs
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        yield Finished(
            finish,
            usage,
            *self._media_usage(t),
            stages=self._stage_figures(t),
            prompt_logprobs=prompt_logprobs,
        )

    def _stage_figures(self, t: Tracked) -> dict[str, StageFigures]:
        order = [s.name for s in self.spec.stages]
        ms = lambda at: round((at - t.started) * 1000, 3)  # noqa: E731
        return {
            s: StageFigures(
                order.index(s),
                str(out.value) if (out := self.spec.stage(s).final_output) is not None else None,
                t.stage_usage.get(s, {}).get("prompt_tokens", 0),
                t.stage_usage.get(s, {}).get("completion_tokens", 0),
                ms(t.first_output[s]) if s in t.first_output else None,
                ms(at),
            )
            for s, at in sorted(t.done.items(), key=lambda kv: order.index(kv[0]))
        }

    def _media_usage(self, t: Tracked) -> tuple[int, int]:
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

    async def _root_cause(self, t: Tracked, err: ErrorMsg) -> OmniError:
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
        return ERRORS.get(err.code, StageFailed)(err.message, code=err.code)

    async def _final_events(self, rid: str, m: FinalMsg) -> list[Event]:
        if m.kind == OutputKind.TEXT:
            if not (m.text or m.logprobs or m.tool_calls):
                return []
            return [TextDelta(m.text, m.logprobs or [], m.tool_calls or [], m.usage)]
        if m.handle is None:
            return []
        conn = self.payloads.connectors.get(m.handle.connector)
        if conn is None:
            raise StageFailed(f"stage '{m.stage}' sent a handle of unknown connector '{m.handle.connector}'")
        payload, _ = await self.payloads.get(conn, m.stage, "gateway", rid, m.handle)
        if not isinstance(payload, dict):
            raise StageFailed(f"stage '{m.stage}' sent a {type(payload).__name__}, not a payload")
        if m.kind == OutputKind.AUDIO:
            return _audio_events(m.stage, payload)
        # Images and videos are copied out of the payload (megabytes of frames): off the loop.
        if m.kind == OutputKind.IMAGE:
            return await asyncio.to_thread(_image_events, m.stage, payload)
        if m.kind == OutputKind.VIDEO:
            return await asyncio.to_thread(_video_events, m.stage, payload)
        raise StageFailed(f"stage '{m.stage}': output kind '{m.kind}' is not served by this endpoint")


def _audio_events(stage: str, payload: Audio) -> list[Event]:
    audio = payload.get("audio")
    if not isinstance(audio, torch.Tensor):
        raise StageFailed(f"stage '{stage}' sent audio without samples")
    # A copy: the payload is a view on a shm segment, which a slow client must not pin.
    samples = audio.reshape(-1).float().numpy().copy()
    return [AudioChunk(samples, int(payload.get("sample_rate", 24000)))]


def _image_events(stage: str, payload: Images) -> list[Event]:
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


def _video_events(stage: str, payload: VideoFrames) -> list[Event]:
    """One event per unit: `frames` [units] of uint8 [n, F, H, W, 3] in the final unit (None in
    a progress unit), with `step`, `steps` and `final` per unit and the clip's `fps`."""
    frames, step, steps, final = (
        payload.get("frames"),
        payload.get("step"),
        payload.get("steps"),
        payload.get("final"),
    )
    if not (
        isinstance(frames, list)
        and all(isinstance(t, torch.Tensor) for t in (step, steps, final))
        and len(frames) == len(final)  # type: ignore[arg-type]
    ):
        raise StageFailed(f"stage '{stage}' sent video without frames, step, steps and final")
    events: list[Event] = []
    for u, clips in enumerate(frames):
        last = bool(final[u])  # type: ignore[index]
        if last and not (isinstance(clips, torch.Tensor) and clips.dim() == 5 and clips.dtype == torch.uint8):
            raise StageFailed(f"stage '{stage}' sent a final video unit without uint8 frames [n, F, H, W, 3]")
        # Copies: the payload is a view on a shm segment, which a slow client must not pin.
        videos = [clip.numpy().copy() for clip in clips] if last else []
        fps = int(payload.get("fps") or 16)
        events.append(VideoProgress(int(step[u]), int(steps[u]), videos, fps, last))  # type: ignore[index]
    return events
