"""The duplex dialect's audio input: at the client's own rate (resampled to the session's 24
kHz as it comes), each chunk checked against its stated rate and length, and marked as speech
or not (audio marked not speech is heard by VAD as silence, and alone makes no turn)."""

from __future__ import annotations

from omni_gateway.audio import PcmResampler
from omni_gateway.realtime.conversation import decode_pcm
from omni_gateway.realtime.duplex_protocol import DEFAULT_INPUT_RATE, DuplexAppend
from omni_gateway.realtime.live import LiveSession
from omni_gateway.realtime.protocol import PCM_RATE, RealtimeError


class DuplexAudio:
    """A duplex session's audio on its way into the live session's user input."""

    def __init__(self, live: LiveSession) -> None:
        self.live = live
        self.rate = DEFAULT_INPUT_RATE
        self._resampler = PcmResampler(DEFAULT_INPUT_RATE, PCM_RATE)
        self.spoke = False
        """Whether any audio appended since the last commit was not marked `is_speech: false`."""

    async def append(self, event: DuplexAppend) -> None:
        if event.sample_rate_hz is not None and event.sample_rate_hz != self.rate:
            raise RealtimeError(
                f"sample_rate_hz: the session's input is {self.rate} Hz (session.update sets it)",
                param="sample_rate_hz",
            )
        pcm = decode_pcm(event.audio, "audio")
        if event.duration_ms is not None and abs(event.duration_ms - len(pcm) * 500 / self.rate) > 1:
            raise RealtimeError(
                f"duration_ms: {event.duration_ms} is not the audio's length at {self.rate} Hz",
                param="duration_ms",
            )
        speech = event.is_speech is not False
        self.spoke = self.spoke or speech
        await self.live.append(self._resampler.feed(pcm), speech)

    async def flush(self) -> None:
        """The resampler's last samples into the buffer: the user's turn is whole."""
        if tail := self._resampler.flush():
            await self.live.append(tail)

    async def set_rate(self, rate: int) -> None:
        if rate != self.rate:
            await self.flush()
            self.rate, self._resampler = rate, PcmResampler(rate, PCM_RATE)

    def clear(self) -> None:
        """The user's turn so far dropped: its audio, what was typed, the resampler's tail."""
        self._resampler.reset()
        self.live.input.typed.clear()
        self.live.input.buffer.clear()
        self.spoke = False

    def only_silence(self, is_speech: bool | None) -> bool:
        """Whether the turn holds audio marked not speech alone (or the commit says it is not)."""
        user = self.live.input
        return bool(user.buffer.size) and not user.typed and (is_speech is False or not self.spoke)
