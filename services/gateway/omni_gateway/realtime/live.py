"""What a live session is and does whichever dialect the client speaks (OpenAI's Realtime GA,
session.py; vLLM-Omni's duplex, duplex.py): its settings, its conversation, the user's input and
the turns VAD hears in it, its responses (omni_gateway.realtime.response, at most one at a
time), and what of an answer the user heard. Each dialect holds one and turns its client events
into these calls; nothing here depends on which dialect holds it.

Events go out in the protocol's order through one `send`, which waits for the socket (a client
that does not read slows its own response, and nothing piles up here).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import (
    Conversation,
    ConversationItem,
    Part,
    item_from_client,
    messages,
    truncate,
)
from omni_gateway.realtime.playback import Playback
from omni_gateway.realtime.protocol import (
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ResponseParams,
    client_event_id,
    new_id,
)
from omni_gateway.realtime.response import Response, Responses
from omni_gateway.realtime.settings import SettingsRules
from omni_gateway.realtime.user_input import UserInput
from omni_gateway.realtime.vad import SpeechStarted
from omni_gateway.request import PipelineRequest
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import EVERY_ENGINE, Sampling
from omni_pipeline.spec import OutputKind

log = logging.getLogger("omni.gateway")

Send = Callable[[dict[str, Any]], Awaitable[None]]


class LiveSession:
    """A session's state and what it does, for the dialect that holds it."""

    def __init__(
        self, pipeline: Pipeline, send: Send, max_buffer_bytes: int, metrics: GatewayMetrics
    ) -> None:
        self.pipeline = pipeline
        self.id = new_id("sess")
        self._send = send
        self.metrics = metrics
        self.rules = SettingsRules(pipeline)
        self.settings = self.rules.defaults()
        self.conversation = Conversation()
        self.input = UserInput(pipeline, self.id, max_buffer_bytes)
        self.responses = Responses(pipeline, self.emit, self.conversation, metrics, self.id)
        self.playback = Playback()

    async def receive(
        self, data: str | bytes, parse: Callable[[str | bytes], Any], handle: Callable[[Any], Awaitable[None]]
    ) -> None:
        """One client message, `parse`d and `handle`d by the dialect: answered in the protocol's
        events, or an `error` event."""
        event: Any = None
        try:
            event = parse(data)
            await handle(event)
        except RealtimeError as exc:
            event_id = event.event_id if event is not None else client_event_id(data)
            await self.error(exc.message, code=exc.code, param=exc.param, event_id=event_id)
        except Exception as exc:  # a bug of ours: said, logged, and the session goes on
            log.exception("realtime %s: %s", self.id, type(event).__name__)
            event_id = event.event_id if event is not None else None
            await self.error(
                f"internal error: {type(exc).__name__}",
                code="server_error",
                event_id=event_id,
                kind="server_error",
            )

    async def handle(self, event: Any) -> None:
        """The client events both dialects share: the conversation's items and responses."""
        match event:
            case ItemCreate(item=item, previous_item_id=previous):
                if item is None:
                    raise RealtimeError("item: an item to create", param="item")
                await self.add_item(item_from_client(item, "item"), previous)
            case ItemRetrieve(item_id=item_id):
                await self.emit("conversation.item.retrieved", item=self.conversation.get(item_id).wire())
            case ItemDelete(item_id=item_id):
                self.conversation.delete(item_id)
                await self.emit("conversation.item.deleted", item_id=item_id)
            case ItemTruncate(item_id=item_id, content_index=index, audio_end_ms=end):
                await self.truncate(item_id, index, end)
            case ResponseCreate(response=params):
                await self.create_response(params)
            case ResponseCancel(response_id=rid):
                active = self.responses.active
                if active is None or (rid is not None and rid != active.id):
                    raise RealtimeError(
                        "response_id: no such response in progress",
                        code="response_cancel_not_active",
                        param="response_id",
                    )
                await self.cancel("client_cancelled")

    async def close(self) -> None:
        """The socket is gone for good: end the response in progress (its run aborted and
        freed), and the replicas give up the conversation's kept sequence."""
        await self.cancel("client_cancelled")
        await self.pipeline.forget_conversation(self.id)

    async def emit(self, type_: str, **fields: Any) -> None:
        await self._send({"type": type_, "event_id": new_id("event"), **fields})

    async def error(
        self,
        message: str,
        *,
        code: str,
        param: str | None = None,
        event_id: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        error = {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}
        await self.emit("error", error=error)

    # --- the user's side ---------------------------------------------------------------------

    async def detect_turns(self) -> None:
        await self.input.detect(self.settings.turn_detection)

    async def append(self, pcm: bytes, speech: bool = True) -> None:
        """`pcm` into the user's turn, VAD's marks in it acted on (see UserInput.hear)."""
        if self.input.overflows(pcm):
            await self._speech_stopped(self.input.buffer.end_ms)
        for mark in await self.input.hear(pcm, speech):
            if isinstance(mark, SpeechStarted):
                await self._speech_started(mark.at_ms)
            else:
                await self._speech_stopped(mark.at_ms)
        await self.input.settle()

    async def _speech_started(self, at_ms: int) -> None:
        start, item_id = self.input.speech_started(at_ms)
        await self.emit("input_audio_buffer.speech_started", audio_start_ms=start, item_id=item_id)
        if self.input.interrupts:
            if self.responses.active is not None:
                self.metrics.barge_ins.inc()
                await self.cancel("turn_detected")
            await self.keep_what_was_played()

    async def _speech_stopped(self, at_ms: int) -> None:
        item_id = self.input.speech_stopped()
        await self.emit("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        await self.commit(until_ms=at_ms)
        if self.input.detector is not None and self.input.detector.settings.create_response:
            try:
                await self.create_response(ResponseParams())
            except RealtimeError as exc:  # the client's to know, as for its own response.create
                await self.error(exc.message, code=exc.code, param=exc.param)

    async def commit(self, until_ms: int | None = None) -> None:
        """The user's turn (up to `until_ms`) as the conversation's next item."""
        item_id, parts = self.input.commit(until_ms)
        item = ConversationItem("user", parts)
        item.id = item_id or item.id
        await self.add_item(item, None, "input_audio_buffer.committed")

    async def add_item(
        self, item: ConversationItem, previous_item_id: str | None, said: str | None = None
    ) -> None:
        previous = self.conversation.add(item, previous_item_id)
        if said is not None:
            await self.emit(said, item_id=item.id, previous_item_id=previous)
        await self.emit("conversation.item.added", item=item.wire(), previous_item_id=previous)
        await self.emit("conversation.item.done", item=item.wire(), previous_item_id=previous)

    async def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        item = self.conversation.get(item_id)
        if (active := self.responses.active) is not None and active.item is item:
            await self.cancel("client_cancelled")  # what the client says it played ends it
        truncate(item, content_index, audio_end_ms)
        await self._truncated(item_id, content_index, audio_end_ms)

    async def _truncated(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        await self.emit(
            "conversation.item.truncated",
            item_id=item_id,
            content_index=content_index,
            audio_end_ms=audio_end_ms,
        )

    async def barge_in(self) -> None:
        """The user cut in: the answer in progress ends, and what was not played of the latest
        answer leaves the conversation."""
        cut = self.responses.active is not None
        await self.cancel("turn_detected")
        if await self.keep_what_was_played() or cut:
            self.metrics.barge_ins.inc()

    async def keep_what_was_played(self) -> bool:
        """The latest answer cut to what was played (Playback.cut), said; True if it was."""
        if (cut := self.playback.cut()) is None:
            return False
        await self._truncated(cut[0], 0, cut[1])
        return True

    # --- responses ---------------------------------------------------------------------------

    async def create_response(self, params: ResponseParams) -> None:
        if (active := self.responses.active) is not None:
            raise RealtimeError(
                f"response {active.id} is in progress: cancel it or wait for response.done",
                code="conversation_already_has_active_response",
            )
        if self.playback.policy == "ack_only":
            await self.keep_what_was_played()  # the answer before keeps what was played of it
        response, asked = self._response(params)
        await self.responses.start(response, asked)
        self.input.turn_ended = None
        self.playback.started(self.responses.active)

    def _response(self, params: ResponseParams) -> tuple[Response, PipelineRequest]:
        """The response `params` ask for over the session's settings, and its pipeline request."""
        s, rules, unset = self.settings, self.rules, msgspec.UNSET
        modalities = s.output_modalities
        if params.output_modalities is not unset:
            modalities = rules.modalities(params.output_modalities, "response.output_modalities")
        max_tokens = s.max_output_tokens
        if params.max_output_tokens is not unset:
            max_tokens = rules.max_tokens(params.max_output_tokens, "response.max_output_tokens")
        voice = s.voice
        audio = params.audio
        if audio is not unset and audio.output is not unset and audio.output.voice is not unset:
            voice = rules.voice(audio.output.voice, "response.audio.output.voice")
        instructions = s.instructions if params.instructions is unset else params.instructions
        if params.input is not None:
            items = [item_from_client(item, f"response.input.{i}") for i, item in enumerate(params.input)]
        elif params.conversation == "none":
            raise RealtimeError(
                "response.input: a response outside the conversation needs its input", param="response.input"
            )
        else:
            items = list(self.conversation.items)
        part = Part("output_audio" if "audio" in modalities else "output_text", text="", transcript="")
        rid = new_id("resp")
        response = Response(
            id=rid,
            modalities=modalities,
            voice=voice,
            max_output_tokens=max_tokens,
            metadata=params.metadata,
            in_conversation=params.conversation == "auto",
            # Named after its response, as vLLM-Omni's clients expect (their playback acks name it).
            item=ConversationItem("assistant", [part], id=f"item_{rid}", status="in_progress"),
            turn_ended=self.input.turn_ended,
        )
        asked = PipelineRequest(
            None,
            frozenset({OutputKind.TEXT, OutputKind.AUDIO} if response.speaks else {OutputKind.TEXT}),
            RequestInputs(
                modalities=sorted([*modalities, "text"]),
                messages=messages(instructions, items, self.pipeline.spec.gateway.media.max_parts),
                voice=voice,
            ),
            Sampling(
                max_tokens=max_tokens,
                voice=voice,
                temperature=s.temperature,
                # The conversation's own turns: each begins with the last, kept by the thinker.
                prompt_cache_key=self.id if params.input is None and response.in_conversation else None,
            ),
            outputs_param="response.output_modalities",
            voice_param="response.audio.output.voice",
            max_tokens_param="response.max_output_tokens",
            declared=EVERY_ENGINE,
        )
        return response, asked

    async def cancel(self, reason: str) -> None:
        await self.responses.cancel(reason)
