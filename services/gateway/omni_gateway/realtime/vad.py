"""Server VAD: where a user's speech starts and stops in a session's audio, by Silero VAD (the
`silero-vad` package's own model; nothing is downloaded).

Silero reads 16 kHz in windows of 512 samples (32 ms); the session's 24 kHz PCM is resampled as
it comes (soxr's streaming resampler). Speech starts at the first window whose probability
reaches `threshold`; it stops once windows stay under `threshold - 0.15` (Silero's own
hysteresis) for `silence_duration_ms`, and the stop is placed where that silence began. Times
are ms of all the audio appended in the session, as the protocol's `audio_start_ms` are.

A detector holds the model's recurrent state, so each session has its own (loading it takes
about 40 ms). Importing `silero_vad` sets torch to one thread for the process, which suits
the gateway: its tensors are small, its work is I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import soxr
import torch

from omni_gateway.realtime.protocol import PCM_RATE, ServerVad

VAD_RATE: Final = 16000
WINDOW: Final = 512
HYSTERESIS: Final = 0.15


@dataclass(frozen=True)
class SpeechStarted:
    at_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    at_ms: int


Mark = SpeechStarted | SpeechStopped


class TurnDetector:
    """One session's Silero VAD over its appended audio; `feed` runs off the event loop."""

    def __init__(self, settings: ServerVad, offset_ms: int) -> None:
        from silero_vad import load_silero_vad

        self.settings = settings
        self._model: Any = load_silero_vad()
        self._resampler = soxr.ResampleStream(PCM_RATE, VAD_RATE, 1, dtype="float32")
        self._pending = np.zeros(0, dtype=np.float32)
        self._offset_ms = offset_ms
        self._windows = 0
        self.speaking = False
        self._silent_from: int | None = None

    def _ms(self, windows: int) -> int:
        return self._offset_ms + windows * WINDOW * 1000 // VAD_RATE

    def feed(self, pcm: bytes) -> list[Mark]:
        """The starts and stops of speech in `pcm` (PCM16 at 24 kHz, following what came before)."""
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, self._resampler.resample_chunk(samples)])
        marks: list[Mark] = []
        threshold = self.settings.threshold
        with torch.inference_mode():
            while len(self._pending) >= WINDOW:
                window, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
                p = float(self._model(torch.from_numpy(window.copy()), VAD_RATE))
                start, self._windows = self._ms(self._windows), self._windows + 1
                if p >= threshold:
                    self._silent_from = None
                    if not self.speaking:
                        self.speaking = True
                        marks.append(SpeechStarted(start))
                elif self.speaking and p < threshold - HYSTERESIS:
                    if self._silent_from is None:
                        self._silent_from = start
                    if self._ms(self._windows) - self._silent_from >= self.settings.silence_duration_ms:
                        self.speaking = False
                        marks.append(SpeechStopped(self._silent_from))
                        self._silent_from = None
        return marks
