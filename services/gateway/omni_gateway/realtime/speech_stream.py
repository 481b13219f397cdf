"""`WS /v1/audio/speech/stream`: vLLM-Omni's text-in, speech-out socket, as its clients speak it.

The client sends `session.config` (first, and again between utterances to change it), then
`input.text` pieces and `input.done`, which flushes the utterance and keeps the socket open; or
`session.close`. Each piece of speech is one `POST /v1/audio/speech` request through the
pipeline API: the whole utterance (`split_granularity: none`, the default), or each sentence
or clause as soon as the text holds its end (`sentence`, `clause`), so speech starts before the
text is complete. Each goes out as `audio.start`, the audio in binary frames (one whole WAV
or PCM file; or, with `stream_audio` and `pcm`, the PCM as the vocoder makes it), and
`audio.done`; a flush ends with `session.done`. Anything wrong is an `error` event, and the
socket stays open. `instructions`, `language` and `task_type` go to the pipeline as a speech
request's do (a pipeline that cannot honour one refuses it by name); the fields of vLLM-Omni's
config this server cannot honour (voice cloning, word timestamps) are refused by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any, Final, Literal

import msgspec
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from omni_gateway.audio import to_pcm16, wav_bytes
from omni_gateway.errors import OmniError
from omni_gateway.events import AudioChunk
from omni_gateway.pipeline import Pipeline
from omni_gateway.protocol.speech import SpeechRequest
from omni_gateway.realtime.protocol import PCM_RATE, new_id
from omni_gateway.voices.voices import Voices, speech_asked

router = APIRouter()

MAX_TEXT: Final = 4096
"""Characters an utterance holds before its flush (a speech request's `input` limit)."""
NOT_SERVED: Final = {
    "speaker_embedding": "send the voice's clip as ref_audio",
    "initial_codec_chunk_frames": "set the code2wav stage's chunkCodes in the pipeline instead",
    "seed": "POST /v1/audio/speech takes no seed here, so neither does its socket",
}
_SENTENCE_ENDS: Final = ".!?\u3002\uff01\uff1f"
"""And the CJK full stop, exclamation and question marks."""
_CLAUSE_ENDS: Final = _SENTENCE_ENDS + ",;:\uff0c\uff1b\uff1a"
_ENDS: Final = {
    "sentence": re.compile(rf"(?<=[{re.escape(_SENTENCE_ENDS)}])\s+"),
    "clause": re.compile(rf"(?<=[{re.escape(_CLAUSE_ENDS)}])\s+"),
}


class StreamConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`session.config`: vLLM-Omni's `StreamingSpeechSessionConfig`, the fields served."""

    type: Literal["session.config"] = "session.config"
    model: str | None = None
    voice: str | None = None
    speaker: str | None = None
    """vLLM-Omni's other name for `voice`."""
    instructions: str | None = None
    language: str | None = None
    task_type: str | None = None
    response_format: str = "wav"
    speed: float | None = 1.0
    max_new_tokens: int | None = None
    non_streaming_mode: bool | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    stream_audio: bool = False
    word_timestamps: bool = False
    split_granularity: Literal["none", "sentence", "clause"] = "none"


class SpeechError(Exception):
    pass


def parse_config(message: dict[str, Any]) -> StreamConfig:
    for name, why in NOT_SERVED.items():
        if message.get(name) not in (None, False):
            raise SpeechError(f"Invalid session config: {name}: {why}")
    known = {k: v for k, v in message.items() if k not in NOT_SERVED}
    try:
        config = msgspec.convert(known, StreamConfig)
    except msgspec.ValidationError as exc:
        raise SpeechError(f"Invalid session config: {exc}") from None
    if config.word_timestamps:
        raise SpeechError("Invalid session config: word_timestamps: no forced aligner is served here")
    if config.stream_audio and config.response_format != "pcm":
        raise SpeechError("Invalid session config: stream_audio requires response_format 'pcm'")
    return config


def split(text: str, granularity: str) -> tuple[list[str], str]:
    """The complete sentences (or clauses) in `text`, and the rest still to come."""
    if granularity == "none":
        return [], text
    parts = _ENDS[granularity].split(text)
    return [p for p in parts[:-1] if p.strip()], parts[-1]


class SpeechStream:
    """One socket's utterances, each piece spoken through the pipeline API in order."""

    def __init__(self, ws: WebSocket, pipeline: Pipeline, voices: Voices | None) -> None:
        self.ws = ws
        self.pipeline = pipeline
        self.voices = voices
        self.config: StreamConfig | None = None
        self.text = ""
        self.utterance = 0
        self.sentence = 0

    async def error(self, message: str, **extra: Any) -> None:
        await self.ws.send_json({"type": "error", "message": message, **extra})

    async def receive(self, message: dict[str, Any]) -> bool:
        """One client message; False once the client asked to close."""
        kind = message.get("type")
        if kind == "session.config":
            if self.text:
                raise SpeechError("session.config between utterances only: send input.done first")
            config = parse_config(message)
            try:  # every check a speech request passes, now rather than at the first speech
                await self.pipeline.prepare(await speech_asked(self.voices, self.request("-", config)))
            except OmniError as exc:
                raise SpeechError(f"Invalid session config: {exc.message}") from None
            self.config = config
            return True
        if self.config is None:
            raise SpeechError(f"Expected session.config, got: {kind}")
        if kind == "input.text":
            text = message.get("text")
            if not isinstance(text, str):
                raise SpeechError("input.text requires a string value")
            if len(self.text) + len(text) > MAX_TEXT:
                raise SpeechError(f"an utterance holds {MAX_TEXT} characters at most: send input.done")
            done, self.text = split(self.text + text, self.config.split_granularity)
            for piece in done:
                await self.speak(piece)
        elif kind == "input.done":
            if self.text.strip():
                await self.speak(self.text)
            self.text = ""
            await self.ws.send_json(
                {"type": "session.done", "utterance_index": self.utterance, "total_sentences": self.sentence}
            )
            self.utterance += 1
            self.sentence = 0
        elif kind == "session.close":
            return False
        else:
            raise SpeechError(f"Unknown message type: {kind}")
        return True

    def request(self, text: str, config: StreamConfig | None = None) -> SpeechRequest:
        c = config or self.config
        assert c is not None
        try:
            return SpeechRequest(
                model=c.model or self.pipeline.spec.served_model_name,
                input=text,
                voice=c.voice or c.speaker,
                instructions=c.instructions,
                language=c.language,
                task_type=c.task_type,
                max_new_tokens=c.max_new_tokens,
                non_streaming_mode=c.non_streaming_mode,
                ref_audio=c.ref_audio,
                ref_text=c.ref_text,
                x_vector_only_mode=c.x_vector_only_mode,
                response_format=c.response_format,
                speed=1.0 if c.speed is None else c.speed,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise SpeechError(f"Invalid session config: {field}: {first['msg']}") from None

    async def speak(self, text: str) -> None:
        """One piece of speech: audio.start, the audio, audio.done (or an error, and the socket
        goes on)."""
        assert self.config is not None
        req = self.request(text.strip())
        index = {"utterance_index": self.utterance, "sentence_index": self.sentence}
        self.sentence += 1
        start: dict[str, Any] = {
            "type": "audio.start",
            **index,
            "sentence_text": req.input,
            "format": req.response_format,
        }
        streaming = self.config.stream_audio
        if streaming:
            start["sample_rate"] = PCM_RATE
        sent = 0
        try:
            prepared = await self.pipeline.prepare(await speech_asked(self.voices, req))
            await self.ws.send_json(start)
            whole: list[bytes] = []
            rate = 0
            async with contextlib.aclosing(
                self.pipeline.run(new_id("tts").replace("_", "-"), prepared)
            ) as events:
                async for ev in events:
                    if not isinstance(ev, AudioChunk):
                        continue
                    rate = ev.sample_rate
                    pcm = to_pcm16(ev.samples)
                    if streaming:
                        await self.ws.send_bytes(pcm)
                        sent += len(pcm)
                    else:
                        whole.append(pcm)
            if not streaming:
                body = b"".join(whole)
                data = wav_bytes(body, rate or PCM_RATE) if req.response_format == "wav" else body
                await self.ws.send_bytes(data)
                sent = len(data)
        except OmniError as exc:
            partial = {"partial_audio": True, "action": "discard"} if sent else {}
            where = f"utterance {self.utterance}, sentence {index['sentence_index']}"
            await self.error(f"Generation failed for {where}: {exc.message}", **partial)
            return
        await self.ws.send_json({"type": "audio.done", **index, "total_bytes": sent})


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    pipeline: Pipeline = ws.app.state.pipeline
    limits = pipeline.spec.gateway.realtime
    await ws.accept()
    stream = SpeechStream(ws, pipeline, ws.app.state.voices)
    with contextlib.suppress(WebSocketDisconnect):  # the client went: its request was aborted
        while True:
            try:
                async with asyncio.timeout(limits.idle_timeout_s):
                    message = await ws.receive()
            except TimeoutError:
                await stream.error("Idle timeout: no message received")
                await ws.close(1000, "idle")
                return
            if message["type"] == "websocket.disconnect":
                return
            try:
                parsed = msgspec.json.decode(message.get("text") or message.get("bytes") or b"")
            except msgspec.DecodeError:
                await stream.error("Invalid JSON message")
                continue
            if not isinstance(parsed, dict):
                await stream.error("WebSocket messages must be JSON objects")
                continue
            try:
                if not await stream.receive(parsed):
                    await ws.close(1000)
                    return
            except SpeechError as exc:
                await stream.error(str(exc))
