"""A live session in OpenAI's Realtime GA dialect: its client events as the live session's calls
(omni_gateway.realtime.live), and the session as GA describes it (`session_wire`). The session
lives as long as its socket."""

from __future__ import annotations

from typing import Any

import msgspec

from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import decode_pcm
from omni_gateway.realtime.live import LiveSession, Send
from omni_gateway.realtime.protocol import (
    PCM_FORMAT,
    AudioAppend,
    AudioClear,
    AudioCommit,
    SessionUpdate,
    parse_event,
)
from omni_gateway.realtime.response import Responses
from omni_gateway.realtime.settings import updated


class RealtimeSession:
    """A GA session: what its client's events ask of the live session."""

    ended: str | None = None
    """A GA session ends only with its socket."""

    def __init__(
        self, pipeline: Pipeline, send: Send, max_buffer_bytes: int, metrics: GatewayMetrics
    ) -> None:
        self.live = LiveSession(pipeline, send, max_buffer_bytes, metrics)
        self.id = self.live.id

    @property
    def responses(self) -> Responses:
        return self.live.responses

    async def open(self) -> None:
        await self.live.detect_turns()
        await self.live.emit("session.created", session=session_wire(self.live))

    async def receive(self, data: str | bytes) -> None:
        await self.live.receive(data, parse_event, self._handle)

    async def close(self) -> None:
        await self.live.close()

    async def _handle(self, event: Any) -> None:
        live = self.live
        match event:
            case SessionUpdate(session=config):
                before = live.settings.turn_detection
                live.settings = updated(live.settings, config, live.rules)
                if live.settings.turn_detection != before:
                    await live.detect_turns()
                await live.emit("session.updated", session=session_wire(live))
            case AudioAppend(audio=audio):
                await live.append(decode_pcm(audio, "audio"))
            case AudioCommit():
                await live.commit()
            case AudioClear():
                live.input.buffer.clear()
                await live.emit("input_audio_buffer.cleared")
            case _:
                await live.handle(event)


def session_wire(live: LiveSession) -> dict[str, Any]:
    """The session as GA's `session.created` and `session.updated` describe it."""
    s = live.settings
    turn = None if s.turn_detection is None else msgspec.structs.asdict(s.turn_detection)
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": live.id,
        "model": live.pipeline.spec.served_model_name,
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
