"""What a request's client already has, so that a re-run of the request on a fresh route (a
migration) sends only what the client has not had.

A stream that was cut by a lost replica is run again from the start; the re-run's first
outputs are checked against what was already sent and dropped, and the stream goes on from
where it was. That holds only where the pipeline repeats itself for the request (greedy or
seeded sampling, noise from a fixed seed): a re-run that differs from what was sent cannot be
spliced onto it, and the request ends with the error that made it move.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from omni_gateway.events import AudioChunk, Event, Finished, ImageProgress, TextDelta, VideoProgress

AUDIO_CHECKED: Final = 4800
"""Samples before the splice point a re-run's audio is compared on (0.2 s at 24 kHz)."""
AUDIO_TOLERANCE: Final = 1e-3
"""Absolute difference allowed there: another batch on another replica sums in another order."""


class Diverged(Exception):
    """A re-run's outputs differ from what the client already has."""


class Delivered:
    """Everything a request's client has been sent so far, as much as a splice needs."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self.text_chars = 0
        self.logprobs = 0
        self.tool_calls = 0
        self.samples = 0
        self.audio_tail = np.zeros(0, np.float32)
        """The last delivered samples (up to AUDIO_CHECKED), to check a re-run's against."""
        self.image_step = -1

    @property
    def anything(self) -> bool:
        return self.text_chars + self.logprobs + self.tool_calls + self.samples > 0 or self.image_step >= 0

    def record(self, ev: Event) -> None:
        if isinstance(ev, TextDelta):
            self._text.append(ev.text)
            self.text_chars += len(ev.text)
            self.logprobs += len(ev.logprobs)
            self.tool_calls += len(ev.tool_calls)
        elif isinstance(ev, AudioChunk):
            self.samples += len(ev.samples)
            self.audio_tail = np.concatenate([self.audio_tail, ev.samples])[-AUDIO_CHECKED:]
        elif isinstance(ev, ImageProgress | VideoProgress):
            self.image_step = max(self.image_step, ev.step)

    def splice(self) -> Splice:
        """A filter for a re-run's outputs; Diverged where none can work: tool calls already
        sent (a re-run names its calls afresh)."""
        if self.tool_calls:
            raise Diverged("tool calls already sent cannot be sent again")
        return Splice("".join(self._text), self.logprobs, self.samples, self.audio_tail, self.image_step)


class Splice:
    """One re-run's outputs, with what the client already had when it began (what it is sent
    from the re-run is not checked again) checked and taken off."""

    def __init__(
        self, text: str, logprobs: int, samples: int, audio_tail: np.ndarray, image_step: int
    ) -> None:
        self.text, self.logprobs, self.samples = text, logprobs, samples
        self.audio_tail, self.image_step = audio_tail, image_step
        self.text_seen = 0
        self.logprobs_seen = 0
        self.samples_seen = 0

    def __call__(self, ev: Event) -> Event | None:
        """`ev` less what was already delivered; None when nothing of it is new."""
        if isinstance(ev, TextDelta):
            return self._text(ev)
        if isinstance(ev, AudioChunk):
            return self._audio(ev)
        if isinstance(ev, ImageProgress | VideoProgress):
            return ev if ev.is_last or ev.step > self.image_step else None
        if isinstance(ev, Finished) and (self.text_seen < len(self.text) or self.samples_seen < self.samples):
            raise Diverged("its re-run ended before it had repeated what was already sent")
        return ev

    def _text(self, ev: TextDelta) -> TextDelta | None:
        sent = self.text[self.text_seen :]
        n = min(len(ev.text), len(sent))
        if ev.text[:n] != sent[:n]:
            raise Diverged(f"its re-run's text went {ev.text[:n]!r} where {sent[:n]!r} was sent")
        self.text_seen += n
        k = min(len(ev.logprobs), self.logprobs - self.logprobs_seen)
        self.logprobs_seen += k
        if n == 0 and k == 0:
            return ev
        rest = TextDelta(ev.text[n:], ev.logprobs[k:], ev.tool_calls, ev.usage)
        return rest if rest.text or rest.logprobs or rest.tool_calls else None

    def _audio(self, ev: AudioChunk) -> AudioChunk | None:
        sent = self.samples - self.samples_seen
        if sent <= 0:
            return ev
        n = min(len(ev.samples), sent)
        # The part of [samples_seen, samples_seen + n) that the kept tail covers.
        tail = self.audio_tail
        tail_from = self.samples - len(tail)
        lo, hi = max(self.samples_seen, tail_from), self.samples_seen + n
        if lo < hi:
            ours = ev.samples[lo - self.samples_seen : hi - self.samples_seen]
            theirs = tail[lo - tail_from : hi - tail_from]
            if not np.allclose(ours, theirs, rtol=0, atol=AUDIO_TOLERANCE):
                worst = float(np.max(np.abs(ours - theirs)))
                raise Diverged(f"its re-run's audio differs from what was sent by up to {worst:.3g}")
        self.samples_seen += n
        return AudioChunk(ev.samples[n:], ev.sample_rate) if n < len(ev.samples) else None
