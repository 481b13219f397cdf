"""One live session over the Realtime protocol: its settings, its conversation and input audio
buffer, the turns server VAD hears in it, and the answer to each client event. Its responses
run in omni_gateway.realtime.response, at most one at a time.

Events go out in the protocol's order through one `send`, which waits for the socket (a client
that does not read slows its own response, and nothing piles up here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import (
    AudioBuffer,
    Conversation,
    ConversationItem,
    Part,
    decode_pcm,
    item_from_client,
    messages,
    truncate,
)
from omni_gateway.realtime.protocol import (
    PCM_FORMAT,
    PCM_RATE,
    AudioAppend,
    AudioClear,
    AudioCommit,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ResponseParams,
    ServerVad,
    SessionConfig,
    SessionUpdate,
    client_event_id,
    new_id,
    parse_event,
)
from omni_gateway.realtime.response import Response, Responses
from omni_gateway.realtime.vad import SpeechStarted, TurnDetector
from omni_gateway.request import PipelineRequest
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import EVERY_ENGINE, Sampling
from omni_pipeline.spec import OutputKind

log = logging.getLogger("omni.gateway")

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Settings:
    """The session's settings, as `session.update` leaves them."""

    output_modalities: list[str]
    instructions: str = ""
    max_output_tokens: int | None = None
    """None: "inf" (up to the gateway's own limit)."""
    voice: str | None = None
    """None: the model's own default."""
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    """Server VAD unless the client turns it off (null: it commits each turn), as OpenAI's."""
    temperature: float | None = None
    """None: the model's own (the duplex dialect's `session.temperature` sets it; GA has none)."""


class RealtimeSession:
    """A session's state and its answers to each client event."""

    def __init__(
        self, pipeline: Pipeline, send: Send, max_buffer_bytes: int, metrics: GatewayMetrics
    ) -> None:
        self.pipeline = pipeline
        self.id = new_id("sess")
        self._send = send
        self.metrics = metrics
        speaks = OutputKind.AUDIO in pipeline.spec.output_kinds()
        self.settings = Settings(output_modalities=["audio"] if speaks else ["text"])
        self.conversation = Conversation()
        self.buffer = AudioBuffer(max_buffer_bytes)
        self.detector: TurnDetector | None = None
        self._speech_item: str | None = None
        """The id the turn VAD hears now will have, from speech_started to its commit."""
        self._turn_ended: float | None = None
        """When the last user turn was committed (monotonic), until a response answers it."""
        self.responses = Responses(pipeline, self.emit, self.conversation, metrics, self.id)
        self.ended: str | None = None
        """Why the client ended the session by an event of its own (the duplex `session.close`)."""

    # --- the socket's side -------------------------------------------------------------------

    async def open(self) -> None:
        await self._detect_turns()
        await self.emit("session.created", session=self.session_wire())

    async def receive(self, data: str | bytes) -> None:
        """One client message: answered in the protocol's events, or an `error` event."""
        event: Any = None
        try:
            event = self.parse(data)
            await self._handle(event)
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

    def parse(self, data: str | bytes) -> Any:
        """A client message as an event of the session's dialect (here GA's)."""
        return parse_event(data)

    async def close(self) -> None:
        """The socket is gone: end the response in progress (its run aborted and freed), and
        the replicas give up the conversation's kept sequence."""
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

    # --- client events -----------------------------------------------------------------------

    async def _handle(self, event: Any) -> None:
        match event:
            case SessionUpdate(session=config):
                before = self.settings.turn_detection
                self._update(config)
                if self.settings.turn_detection != before:
                    await self._detect_turns()
                await self.emit("session.updated", session=self.session_wire())
            case AudioAppend(audio=audio):
                await self.append(decode_pcm(audio, "audio"))
            case AudioCommit():
                await self.commit()
            case AudioClear():
                self.buffer.clear()
                await self.emit("input_audio_buffer.cleared")
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

    def _update(self, config: SessionConfig) -> None:
        """Check every field first, then set them: an update is taken whole or not at all."""
        s = Settings(**vars(self.settings))
        if config.model is not msgspec.UNSET and config.model != self.pipeline.spec.served_model_name:
            raise RealtimeError(
                f"session.model: model '{config.model}' is not served here", param="session.model"
            )
        if config.output_modalities is not msgspec.UNSET:
            s.output_modalities = self._modalities(config.output_modalities, "session.output_modalities")
        if config.instructions is not msgspec.UNSET:
            s.instructions = config.instructions
        if config.max_output_tokens is not msgspec.UNSET:
            s.max_output_tokens = self._max_tokens(config.max_output_tokens, "session.max_output_tokens")
        audio = config.audio
        turn = audio.input.turn_detection if audio and audio.input else msgspec.UNSET
        if turn is not msgspec.UNSET:
            s.turn_detection = turn
        if audio is not msgspec.UNSET and audio.output is not msgspec.UNSET:
            out = audio.output
            if out.speed is not msgspec.UNSET and out.speed != 1.0:
                raise RealtimeError(
                    "session.audio.output.speed: only 1.0 is served", param="session.audio.output.speed"
                )
            if out.voice is not msgspec.UNSET:
                s.voice = self._voice(out.voice, "session.audio.output.voice")
        self.settings = s

    def _modalities(self, asked: list[str], param: str) -> list[str]:
        if sorted(set(asked)) not in (["audio"], ["text"]):
            raise RealtimeError(f"{param}: ['audio'] (speech and its transcript) or ['text']", param=param)
        if asked == ["audio"] and OutputKind.AUDIO not in self.pipeline.spec.output_kinds():
            raise RealtimeError(
                f"{param}: model '{self.pipeline.spec.served_model_name}' does not speak", param=param
            )
        return list(asked)

    def _max_tokens(self, asked: int | str, param: str) -> int | None:
        if asked == "inf":
            return None
        limit = self.pipeline.spec.gateway.max_tokens
        if not isinstance(asked, int) or not 1 <= asked <= limit:
            raise RealtimeError(f"{param}: 1 to {limit}, or 'inf'", param=param)
        return asked

    def _voice(self, voice: str | None, param: str) -> str | None:
        voices = self.pipeline.voices()
        if voice is not None and voices is not None and voice not in voices:
            listed = ", ".join(sorted(voices)) or "none (this model's speech takes no voice)"
            raise RealtimeError(
                f"{param}: voice '{voice}' is not one of this model's voices: {listed}", param=param
            )
        return voice

    async def _detect_turns(self) -> None:
        turn = self.settings.turn_detection
        self._speech_item = None
        if turn is None:
            self.detector = None
            return
        self.detector = await asyncio.to_thread(TurnDetector, turn, self.buffer.end_ms)

    async def append(self, pcm: bytes, speech: bool = True) -> None:
        """`pcm` into the buffer (and to VAD: as silence where the client says it is not
        `speech`, as the duplex dialect lets it)."""
        if (
            self.detector is not None
            and self.detector.speaking
            and self.buffer.size + len(pcm) > self.buffer.max_bytes
        ):
            # Speech longer than the buffer holds: the turn so far ends here, the rest is the next.
            await self._speech_stopped(self.buffer.end_ms)
        self.buffer.append(pcm)
        if self.detector is None:
            await self._send_ahead()
            return
        heard = pcm if speech else bytes(len(pcm))
        for mark in await asyncio.to_thread(self.detector.feed, heard):
            if isinstance(mark, SpeechStarted):
                await self._speech_started(mark.at_ms)
            else:
                await self._speech_stopped(mark.at_ms)
        if not self.detector.speaking:  # keep only what may pad the next turn's start
            self.buffer.keep_from(self.buffer.end_ms - self.detector.settings.prefix_padding_ms)
        await self._send_ahead()

    async def _send_ahead(self) -> None:
        """The turn's audio not sent yet, ahead to the replica that encodes it as it arrives
        (Pipeline.audio_in): each append with manual turns, and with VAD while it hears speech
        (from the turn's padding on)."""
        if self.detector is not None and not self.detector.speaking:
            return
        at, pcm = self.buffer.unsent()
        if pcm:
            await self.pipeline.audio_in(self.id, at // 2, pcm, PCM_RATE)

    async def _speech_started(self, at_ms: int) -> None:
        assert self.detector is not None
        start = max(at_ms - self.detector.settings.prefix_padding_ms, self.buffer.start_ms)
        self.buffer.keep_from(start)
        self._speech_item = new_id("item")
        await self.emit("input_audio_buffer.speech_started", audio_start_ms=start, item_id=self._speech_item)
        if self.responses.active is not None and self.detector.settings.interrupt_response:
            self.metrics.barge_ins.inc()
            await self.cancel("turn_detected")

    async def _speech_stopped(self, at_ms: int) -> None:
        assert self.detector is not None
        self._speech_item = item_id = self._speech_item or new_id("item")
        await self.emit("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        await self.commit(until_ms=at_ms)
        if self.detector.settings.create_response:
            try:
                await self.create_response(ResponseParams())
            except RealtimeError as exc:  # the client's to know, as for its own response.create
                await self.error(exc.message, code=exc.code, param=exc.param)

    async def commit(self, until_ms: int | None = None) -> None:
        """The buffer (up to `until_ms`) as the user's next item: VAD's heard turn keeps the id
        its speech_started gave it."""
        item = ConversationItem("user", self._user_parts(until_ms))
        item.id, self._speech_item = self._speech_item or item.id, None
        previous = self.conversation.add(item)
        self._turn_ended = time.monotonic()
        await self.emit("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)
        await self._announce(item, previous)

    def _user_parts(self, until_ms: int | None) -> list[Part]:
        """What the user's committed turn holds: the buffer's audio (up to `until_ms`)."""
        if self.buffer.size == 0:
            raise RealtimeError(
                "the input audio buffer is empty: append audio before committing",
                code="input_audio_buffer_commit_empty",
            )
        return [Part("input_audio", pcm=self.buffer.take(until_ms))]

    async def add_item(self, item: ConversationItem, previous_item_id: str | None) -> None:
        previous = self.conversation.add(item, previous_item_id)
        await self._announce(item, previous)

    async def _announce(self, item: ConversationItem, previous: str | None) -> None:
        await self.emit("conversation.item.added", item=item.wire(), previous_item_id=previous)
        await self.emit("conversation.item.done", item=item.wire(), previous_item_id=previous)

    async def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        item = self.conversation.get(item_id)
        if (active := self.responses.active) is not None and active.item is item:
            await self.cancel("client_cancelled")  # what the client says it played ends it
        truncate(item, content_index, audio_end_ms)
        await self.emit(
            "conversation.item.truncated",
            item_id=item_id,
            content_index=content_index,
            audio_end_ms=audio_end_ms,
        )

    # --- responses ---------------------------------------------------------------------------

    async def create_response(self, params: ResponseParams) -> None:
        if (active := self.responses.active) is not None:
            raise RealtimeError(
                f"response {active.id} is in progress: cancel it or wait for response.done",
                code="conversation_already_has_active_response",
            )
        s = self.settings
        modalities = s.output_modalities
        if params.output_modalities is not msgspec.UNSET:
            modalities = self._modalities(params.output_modalities, "response.output_modalities")
        max_tokens = s.max_output_tokens
        if params.max_output_tokens is not msgspec.UNSET:
            max_tokens = self._max_tokens(params.max_output_tokens, "response.max_output_tokens")
        voice = s.voice
        audio = params.audio
        if (
            audio is not msgspec.UNSET
            and audio.output is not msgspec.UNSET
            and audio.output.voice is not msgspec.UNSET
        ):
            voice = self._voice(audio.output.voice, "response.audio.output.voice")
        instructions = s.instructions if params.instructions is msgspec.UNSET else params.instructions
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
            turn_ended=self._turn_ended,
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
        await self.responses.start(response, asked)
        self._turn_ended = None

    async def cancel(self, reason: str) -> None:
        await self.responses.cancel(reason)

    def session_wire(self) -> dict[str, Any]:
        s = self.settings
        turn = None if s.turn_detection is None else msgspec.structs.asdict(s.turn_detection)
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.pipeline.spec.served_model_name,
            "output_modalities": s.output_modalities,
            "instructions": s.instructions,
            "max_output_tokens": s.max_output_tokens if s.max_output_tokens is not None else "inf",
            "audio": {
                "input": {
                    "format": PCM_FORMAT,
                    "turn_detection": turn,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {"format": PCM_FORMAT, "voice": s.voice, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "none",
        }
