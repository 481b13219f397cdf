"""Text to speech: the vocoder's chunks -> the response body as they come (WAV, raw PCM, or
OpenAI's `speech.audio.delta` SSE events)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from omni_gateway.audio import to_pcm16, wav_stream_header
from omni_gateway.errors import error_from
from omni_gateway.events import AudioChunk, Event, Finished
from omni_gateway.protocol.speech import SpeechRequest


def speech_usage(f: Finished) -> dict[str, int]:
    """OpenAI's speech usage: the text tokens read, and the audio tokens made (what the stages
    feeding the vocoder made for it: a talker's codec codes)."""
    return {
        "input_tokens": f.prompt_tokens,
        "output_tokens": f.fed_units,
        "total_tokens": f.prompt_tokens + f.fed_units,
    }


async def _pcm(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    ev: Event | None = first
    while ev is not None:
        if isinstance(ev, AudioChunk):
            yield to_pcm16(ev.samples)
        ev = await anext(events, None)


async def audio_stream(
    req: SpeechRequest, first: AudioChunk, events: AsyncIterator[Event]
) -> AsyncIterator[bytes]:
    """Chunked audio. A WAV starts with a header of unknown length, as streaming servers write
    it. A failure mid-stream can only cut the response short (it raises)."""
    if req.response_format == "wav":
        yield wav_stream_header(first.sample_rate)
    async for pcm in _pcm(first, events):
        yield pcm


async def sse_stream(
    req: SpeechRequest, first: AudioChunk, events: AsyncIterator[Event]
) -> AsyncIterator[str]:
    """`speech.audio.delta` events, base64 pieces of the same bytes `audio_stream` sends, then
    `speech.audio.done` (or `error`)."""

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    finished = Finished("stop", {})

    async def noting_the_end() -> AsyncIterator[Event]:
        nonlocal finished
        async for ev in events:
            if isinstance(ev, Finished):
                finished = ev
            yield ev

    try:
        async for data in audio_stream(req, first, noting_the_end()):
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        yield sse({"type": "speech.audio.done", "usage": speech_usage(finished)})
    except Exception as exc:
        yield sse({"type": "error", **error_from(exc).body()})
