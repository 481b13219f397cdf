"""A live session's responses, one at a time: each a run of the pipeline API over the
conversation, told to the client as the protocol's events, in its order.

A response that is cancelled (`response.cancel`, the user's speech, the socket closing) has its
pipeline run closed, which aborts it at every stage and frees what it held; its item keeps
what was sent, and its closing events still go out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from omni_gateway.audio import to_pcm16
from omni_gateway.errors import OmniError
from omni_gateway.events import AudioChunk, Finished, TextDelta
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import Conversation, ConversationItem, Part
from omni_gateway.realtime.protocol import PCM_FORMAT, PCM_RATE, RealtimeError
from omni_gateway.request import PipelineRequest
from omni_pipeline import tracing

log = logging.getLogger("omni.gateway")

Emit = Callable[..., Awaitable[None]]
"""The session's `emit(type, **fields)`: one event to the client, in order."""


@dataclass
class Response:
    id: str
    modalities: list[str]
    voice: str | None
    max_output_tokens: int | None
    metadata: dict[str, str] | None
    in_conversation: bool
    item: ConversationItem
    task: asyncio.Task[None] | None = None
    cancelled: str | None = None
    """Why it was cancelled: `client_cancelled`, `turn_detected`."""
    usage: dict[str, Any] = field(default_factory=dict)
    turn_ended: float | None = None
    """When the user's turn it answers was committed (monotonic), if it answers one."""
    ending: bool = False
    """Its run is over and its closing events are going out."""

    @property
    def part(self) -> Part:
        return self.item.parts[0]

    @property
    def speaks(self) -> bool:
        return "audio" in self.modalities


@dataclass(eq=False)
class Responses:
    """One session's responses: at most one in progress (`active`)."""

    pipeline: Pipeline
    emit: Emit
    conversation: Conversation
    metrics: GatewayMetrics
    session_id: str
    active: Response | None = None
    count: int = 0

    async def start(self, response: Response, asked: PipelineRequest) -> None:
        """Check it as the chat API would, then run it in a task of its own; a request the
        pipeline refuses is the client's to know (RealtimeError), before anything is announced."""
        try:
            prepared = await self.pipeline.prepare(asked)
        except OmniError as exc:  # a 400 of the chat API, or a pipeline that cannot take it now
            param = _client_param(exc.param)
            raise RealtimeError(exc.message, code=exc.code or exc.type, param=param) from None
        self.active = response
        self.count += 1
        response.task = asyncio.get_running_loop().create_task(
            self._run(response, prepared), name=response.id
        )

    async def cancel(self, reason: str) -> None:
        """End the response in progress, if any, as `cancelled`; returns once it has ended (a
        caller cancelled meanwhile is cancelled)."""
        response = self.active
        if response is None or response.task is None:
            return
        if response.cancelled is None and not response.ending:
            response.cancelled = reason
            response.task.cancel()
        await asyncio.wait((response.task,))

    async def _run(self, r: Response, prepared: Any) -> None:
        """One response, a trace of its own: its turn's, across every stage (under the socket's
        span, a whole session would be one trace)."""
        attributes = {"omni.session_id": self.session_id, "omni.response_id": r.id}
        with tracing.span("omni.realtime.response", Context(), SpanKind.SERVER, attributes) as span:
            span.set_attribute("omni.outcome", await self._respond(r, prepared))

    async def _respond(self, r: Response, prepared: Any) -> str:
        """Run it, say how it went, and end it; returns its status."""
        status, details = "completed", None
        try:
            await self._begin(r)
            rid = r.id.replace("resp_", "rt-")
            async with contextlib.aclosing(self.pipeline.run(rid, prepared)) as events:
                async for ev in events:
                    await self._deliver(r, ev)
            if r.usage.get("finish_reason") == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            if r.cancelled is None:  # not ours: the session is being torn down
                raise
            status, details = "cancelled", {"type": "cancelled", "reason": r.cancelled}
        except OmniError as exc:
            log.warning("realtime %s: response %s failed: %s", self.session_id, r.id, exc.message)
            status = "failed"
            details = {
                "type": "failed",
                "error": {"type": exc.type, "code": exc.code, "message": exc.message},
            }
        except Exception as exc:  # a bug of ours: the response fails, the session goes on
            log.exception("realtime %s: response %s", self.session_id, r.id)
            status = "failed"
            details = {
                "type": "failed",
                "error": {"type": "server_error", "code": None, "message": repr(exc)},
            }
        finally:
            r.ending = True  # a cancel from here on waits for the end rather than cutting it short
        try:
            await self._end(r, status, details)
        finally:
            if self.active is r:
                self.active = None
        return status

    async def _begin(self, r: Response) -> None:
        await self.emit("response.created", response=self._response_wire(r, "in_progress"))
        previous = self.conversation.add(r.item) if r.in_conversation else None
        await self.emit("response.output_item.added", response_id=r.id, output_index=0, item=r.item.wire())
        if r.in_conversation:
            await self.emit("conversation.item.added", item=r.item.wire(), previous_item_id=previous)
        await self.emit("response.content_part.added", **self._at(r), part=self._part_wire(r))

    async def _deliver(self, r: Response, ev: Any) -> None:
        if isinstance(ev, TextDelta) and ev.text:
            if r.speaks:
                r.part.transcript = (r.part.transcript or "") + ev.text
                await self.emit("response.output_audio_transcript.delta", **self._at(r), delta=ev.text)
            else:
                r.part.text = (r.part.text or "") + ev.text
                await self.emit("response.output_text.delta", **self._at(r), delta=ev.text)
        elif isinstance(ev, AudioChunk) and r.speaks:
            if ev.sample_rate != PCM_RATE:
                raise OmniError(f"the model speaks at {ev.sample_rate} Hz; audio/pcm is {PCM_RATE} Hz")
            if r.part.audio_bytes == 0 and r.turn_ended is not None:
                self.metrics.speech_to_audio.observe(time.monotonic() - r.turn_ended)
            pcm = to_pcm16(ev.samples)
            r.part.audio_bytes += len(pcm)
            await self.emit(
                "response.output_audio.delta", **self._at(r), delta=base64.b64encode(pcm).decode()
            )
        elif isinstance(ev, Finished):
            text_out = ev.usage.get("completion_tokens", 0)
            r.usage = {
                "finish_reason": ev.finish_reason,
                "total_tokens": ev.usage.get("prompt_tokens", 0) + text_out + ev.fed_units,
                "input_tokens": ev.usage.get("prompt_tokens", 0),
                "output_tokens": text_out + ev.fed_units,
                "input_token_details": {"cached_tokens": ev.usage.get("cached_tokens", 0)},
                "output_token_details": {"text_tokens": text_out, "audio_tokens": ev.fed_units},
            }

    async def _end(self, r: Response, status: str, details: dict[str, Any] | None) -> None:
        at = self._at(r)
        if r.speaks:
            await self.emit("response.output_audio.done", **at)
            await self.emit("response.output_audio_transcript.done", **at, transcript=r.part.transcript or "")
        else:
            await self.emit("response.output_text.done", **at, text=r.part.text or "")
        await self.emit("response.content_part.done", **at, part=self._part_wire(r))
        r.item.status = "completed" if status == "completed" else "incomplete"
        await self.emit("response.output_item.done", response_id=r.id, output_index=0, item=r.item.wire())
        if r.in_conversation:
            await self.emit("conversation.item.done", item=r.item.wire())
        await self.emit("response.done", response=self._response_wire(r, status, details))
        self.metrics.live_responses.labels(status=status).inc()

    # --- what events show --------------------------------------------------------------------

    def _at(self, r: Response) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}

    def _part_wire(self, r: Response) -> dict[str, Any]:
        if r.speaks:
            return {"type": "audio", "transcript": r.part.transcript or ""}
        return {"type": "text", "text": r.part.text or ""}

    def _response_wire(
        self, r: Response, status: str, details: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        usage = {k: v for k, v in r.usage.items() if k != "finish_reason"} or None
        return {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [r.item.wire()] if status != "in_progress" else [],
            "conversation_id": self.session_id if r.in_conversation else None,
            "output_modalities": r.modalities,
            "max_output_tokens": r.max_output_tokens if r.max_output_tokens is not None else "inf",
            "audio": {"output": {"format": PCM_FORMAT, "voice": r.voice}},
            "metadata": r.metadata,
            "usage": usage,
        }


def _client_param(param: str | None) -> str | None:
    """A pre-flight check names the chat message's part (`messages.1.content.0`); the client
    sent conversation items, so name the kind of field instead."""
    if param is None or not param.startswith("messages"):
        return param
    return "item.content"
