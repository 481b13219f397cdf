"""The user's side of a live session: the audio appended since the last commit, where server VAD
hears speech start and stop in it, text typed into the turn (the duplex dialect's), and what a
commit makes of them; the turn's audio goes ahead to be encoded as it arrives."""

from __future__ import annotations

import asyncio
import time

from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import AudioBuffer, Part
from omni_gateway.realtime.protocol import PCM_RATE, RealtimeError, ServerVad, new_id
from omni_gateway.realtime.vad import Mark, TurnDetector


class UserInput:
    """The next user turn, until it is committed as the conversation's item."""

    def __init__(self, pipeline: Pipeline, session_id: str, max_buffer_bytes: int) -> None:
        self.pipeline = pipeline
        self.session_id = session_id
        self.buffer = AudioBuffer(max_buffer_bytes)
        self.detector: TurnDetector | None = None
        self.typed: list[str] = []
        """Text the client typed into the turn (input.text.append), until its commit."""
        self.speech_item: str | None = None
        """The id the turn VAD hears now will have, from speech_started to its commit."""
        self.turn_ended: float | None = None
        """When the last user turn was committed (monotonic), until a response answers it."""

    async def detect(self, turn: ServerVad | None) -> None:
        """Server VAD with these settings from now on (None: the client commits each turn)."""
        self.speech_item = None
        self.detector = (
            None if turn is None else await asyncio.to_thread(TurnDetector, turn, self.buffer.end_ms)
        )

    @property
    def interrupts(self) -> bool:
        """Whether speech VAD hears cuts the answer in progress."""
        return self.detector is not None and self.detector.settings.interrupt_response

    def overflows(self, pcm: bytes) -> bool:
        """Whether `pcm` would overflow the buffer during a turn VAD hears: the turn so far ends
        before it, and the rest is the next."""
        speaking = self.detector is not None and self.detector.speaking
        return speaking and self.buffer.size + len(pcm) > self.buffer.max_bytes

    async def hear(self, pcm: bytes, speech: bool = True) -> list[Mark]:
        """`pcm` into the buffer, and VAD's marks in it (as silence where the client says it is
        not `speech`, as the duplex dialect lets it); the session acts on them, then `settle`s."""
        self.buffer.append(pcm)
        if self.detector is None:
            return []
        return await asyncio.to_thread(self.detector.feed, pcm if speech else bytes(len(pcm)))

    async def settle(self) -> None:
        """After an append's marks: outside speech, only what may pad the next turn's start is
        kept; the turn's audio not sent yet goes ahead to the replica that encodes it as it
        arrives (Pipeline.audio_in): each append with manual turns, with VAD while it hears
        speech (from the turn's padding on)."""
        if self.detector is not None and not self.detector.speaking:
            self.buffer.keep_from(self.buffer.end_ms - self.detector.settings.prefix_padding_ms)
            return
        at, pcm = self.buffer.unsent()
        if pcm:
            await self.pipeline.audio_in(self.session_id, at // 2, pcm, PCM_RATE)

    def speech_started(self, at_ms: int) -> tuple[int, str]:
        """Where the turn VAD heard begins (its padding included), and its item's id."""
        assert self.detector is not None
        start = max(at_ms - self.detector.settings.prefix_padding_ms, self.buffer.start_ms)
        self.buffer.keep_from(start)
        self.speech_item = new_id("item")
        return start, self.speech_item

    def speech_stopped(self) -> str:
        """The id of the turn VAD heard end."""
        self.speech_item = self.speech_item or new_id("item")
        return self.speech_item

    def commit(self, until_ms: int | None) -> tuple[str | None, list[Part]]:
        """The turn as an item's id (VAD's heard turn keeps the one speech_started gave it;
        None: a new one) and parts: what the client typed, then what it said (up to
        `until_ms`)."""
        parts = [Part("input_text", text="".join(self.typed))] if self.typed else []
        if self.buffer.size:
            parts.append(Part("input_audio", pcm=self.buffer.take(until_ms)))
        if not parts:
            raise RealtimeError(
                "the input audio buffer is empty: append audio before committing",
                code="input_audio_buffer_commit_empty",
            )
        self.typed.clear()
        item_id, self.speech_item = self.speech_item, None
        self.turn_ended = time.monotonic()
        return item_id, parts
