"""A live session's audio, encoded while the user is still speaking, so that the end of speech
leaves little work before the answer.

A gateway sends a realtime session's input audio, as it is appended, to the replica of the
source stage its next response will run on (`AudioInMsg`, to engines that have `audio_ahead`;
docs/realtime.md). Here it is resampled as it comes (soxr's stream, which makes the samples its
one-shot resample makes of the whole clip), and each time another window of features is
complete, the features of the audio so far are extracted and the windows not yet encoded are
encoded, on the compute thread between other requests' steps.

Nothing here is trusted to be the request's audio. The response's request carries its whole
clip, as any request does, and the engine builds its features the usual way. Each window of
those features that equals, by digest, a window encoded ahead takes that window's encoder
rows, and only the others are encoded then. So what a response reads is what its own audio
makes, whether a piece was missed, a turn ended mid-window, or the features changed. They do
change: the features' floor follows the loudest frame so far, so a louder frame later changes
the windows before it, and those are encoded again.

This holds only for an encoder whose windows do not see each other, as the Qwen-Omni audio
towers' do not (models/qwen_omni/audio_windows.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import soxr
import torch

from omni_stage.engines.prompt_cache import DEFAULT_IDLE_S, digest

log = logging.getLogger("omni.stage")

DEFAULT_STREAMS: Final = 16
"""Sessions whose audio a replica encodes ahead at once (engine.args.audioAheadStreams)."""
DEFAULT_SECONDS: Final = 120.0
"""Audio per session it encodes ahead, at most (engine.args.audioAheadSeconds); beyond it, the
rest of a turn is encoded when its response comes."""


class WindowEncoder(Protocol):
    """A model's audio encoder, as far as windows of it can run alone."""

    rate: int
    """Samples per second its features read."""
    window: int
    """Feature frames one window of the encoder takes."""

    def features(self, samples: np.ndarray) -> torch.Tensor:
        """The features of a mono float32 clip at `rate`, [bins, frames], as a request's clip
        of these samples has them (dtype included): what the digests compare."""
        ...

    def final_frames(self, samples: int) -> int:
        """How many of a clip's first frames no sample after its first `samples` changes."""
        ...

    def encode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The encoder's rows of each window of features [bins, <= window], alone (on the
        compute thread)."""
        ...


@dataclass(eq=False)
class _Stream:
    """One session's audio in: what has arrived, and its windows encoded so far by digest."""

    rate: int
    resampler: Any
    received: int = 0
    """Samples arrived, at `rate`: where the next piece must start."""
    pieces: list[np.ndarray] = field(default_factory=list)
    """The audio resampled to the encoder's rate, in the pieces it came in."""
    windows: dict[bytes, torch.Tensor] = field(default_factory=dict)
    worked: int = 0
    """Complete windows the last round of work saw."""
    task: asyncio.Task[None] | None = None
    used: float = field(default_factory=time.monotonic)

    @property
    def samples(self) -> np.ndarray:
        if len(self.pieces) > 1:
            self.pieces = [np.concatenate(self.pieces)]
        return self.pieces[0] if self.pieces else np.zeros(0, np.float32)


class AudioAhead:
    """A replica's sessions' audio, encoded window by window as it arrives; see the module."""

    def __init__(
        self,
        encoder: WindowEncoder,
        run: Callable[..., Awaitable[Any]],
        streams: int = DEFAULT_STREAMS,
        seconds: float = DEFAULT_SECONDS,
        idle_s: float = DEFAULT_IDLE_S,
    ) -> None:
        if streams < 1 or seconds <= 0 or idle_s <= 0:
            raise ValueError("audioAheadStreams must be at least 1, audioAheadSeconds more than 0")
        self.encoder = encoder
        self._run = run
        self.capacity = streams
        self.max_samples = int(seconds * encoder.rate)
        self.idle_s = idle_s
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self.windows_ahead = 0
        """Windows a request took encoded ahead, since the start (a metric)..."""
        self.windows_late = 0
        """...and those it encoded itself (none ahead, or not equal)."""

    def __len__(self) -> int:
        return len(self._streams)

    def append(self, key: str, start: int, pcm: bytes, rate: int) -> None:
        """A piece of a session's audio: 16-bit PCM at `rate`, from sample `start` of its turn
        (0 begins a turn, and gives up what was encoded of the turn before, if no request took
        it). A piece that does not follow the last (one missed) ends the turn's work ahead, and
        one that is not 16-bit PCM at a rate from 8 to 192 kHz is dropped."""
        if len(pcm) % 2 or not 8000 <= rate <= 192000 or start < 0:
            log.warning("audio ahead: dropped a piece of %d bytes at %d Hz", len(pcm), rate)
            return
        s = self._streams.get(key)
        if start == 0:
            if s is not None:
                self._stop(s)
            s = _Stream(rate, soxr.ResampleStream(rate, self.encoder.rate, 1, dtype="float32", quality="HQ"))
            self._streams[key] = s
            self._streams.move_to_end(key)
            while len(self._streams) > self.capacity:
                self._stop(self._streams.popitem(last=False)[1])
        elif s is None or s.resampler is None or start != s.received or rate != s.rate:
            if s is not None:
                s.resampler = None  # the turn's audio has a gap: nothing more of it is worked on
            return
        s.used = time.monotonic()
        # As soundfile reads a 16-bit WAV: what the request's own clip is decoded to.
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        s.received += len(x)
        if sum(len(p) for p in s.pieces) + len(x) > self.max_samples:
            s.resampler = None
            return
        s.pieces.append(s.resampler.resample_chunk(x))
        if s.task is None or s.task.done():
            s.task = asyncio.create_task(self._work(s), name=f"audio-ahead-{key}")

    async def take(self, key: str) -> dict[bytes, torch.Tensor]:
        """The session's windows encoded ahead, now the caller's alone, once every window complete
        in its audio so far is encoded; empty if none. Audio sent faster than it is encoded (a
        client that appends a recorded turn at once) waits here for the rounds left, which the
        request would otherwise run itself: the same work, and what it encodes is the same."""
        s = self._streams.pop(key, None)
        if s is None:
            return {}
        await self._done(s)  # popped, so no piece comes after: the work ends once caught up
        s.resampler = None
        return dict(s.windows)

    async def caught_up(self, key: str) -> None:
        """Return once every window complete in the session's audio so far is encoded."""
        if (s := self._streams.get(key)) is not None:
            await self._done(s)

    @staticmethod
    async def _done(s: _Stream) -> None:
        """Wait for the stream's work to end, however it ends (a caller cancelled meanwhile is
        cancelled, and the work goes on)."""
        if s.task is not None and not s.task.done():
            await asyncio.wait((s.task,))

    def forget(self, key: str) -> None:
        """The session closed: its audio and windows go."""
        if (s := self._streams.pop(key, None)) is not None:
            self._stop(s)

    def clear(self) -> None:
        for s in self._streams.values():
            self._stop(s)
        self._streams.clear()

    def expire(self) -> int:
        until = time.monotonic() - self.idle_s
        stale = [k for k, s in self._streams.items() if s.used < until]
        for k in stale:
            self.forget(k)
        return len(stale)

    def _stop(self, s: _Stream) -> None:
        s.resampler = None
        if s.task is not None:
            s.task.cancel()

    async def _work(self, s: _Stream) -> None:
        """Encode the windows complete so far, then again while more come complete."""
        try:
            while s.resampler is not None:
                samples = s.samples
                complete = self.encoder.final_frames(len(samples)) // self.encoder.window
                if complete <= s.worked:
                    return
                s.worked = complete
                found = await self._run(self._encode_ahead, samples, complete, dict(s.windows))
                s.windows = found
        except asyncio.CancelledError:
            raise
        except Exception:  # the request encodes what is missing: nothing is lost but time
            log.exception("audio ahead: a window failed to encode")

    def _encode_ahead(
        self, samples: np.ndarray, complete: int, had: dict[bytes, torch.Tensor]
    ) -> dict[bytes, torch.Tensor]:
        """(On the compute thread.) The rows of the first `complete` windows of the clip so far,
        by digest: those encoded before that are unchanged, the rest encoded now."""
        feats = self.encoder.features(samples)
        w = self.encoder.window
        windows = [feats[:, i * w : (i + 1) * w] for i in range(complete)]
        keys = [digest(f) for f in windows]
        todo = [i for i, k in enumerate(keys) if k not in had]
        rows = self.encoder.encode([windows[i] for i in todo]) if todo else []
        found = {k: had[k] for k in keys if k in had}
        found |= {keys[i]: r for i, r in zip(todo, rows, strict=True)}
        return found

    def encoded(
        self, features: torch.Tensor, lengths: list[int], ahead: dict[bytes, torch.Tensor]
    ) -> torch.Tensor:
        """(On the compute thread.) The encoder's rows of a request's clips (`features`
        [clips, bins, frames], each clip's first `lengths` frames), in order, window by window:
        each window's rows encoded ahead where a window of `ahead` equals it, the others now."""
        w = self.encoder.window
        windows = [features[c, :, i : min(i + w, n)] for c, n in enumerate(lengths) for i in range(0, n, w)]
        rows: list[torch.Tensor | None] = [ahead.get(digest(f)) for f in windows]
        todo = [i for i, r in enumerate(rows) if r is None]
        for i, r in zip(todo, self.encoder.encode([windows[i] for i in todo]) if todo else [], strict=True):
            rows[i] = r
        self.windows_ahead += len(windows) - len(todo)
        self.windows_late += len(todo)
        return torch.cat([r for r in rows if r is not None])
