"""Audio on the wire: float samples -> PCM16, WAV files and streamable WAV headers, and a client's
PCM16 stream at another rate."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import soxr


def to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_bytes(pcm16: bytes, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16)
    return buf.getvalue()


def wav_stream_header(sample_rate: int) -> bytes:
    """A WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming servers do)."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


class PcmResampler:
    """A client's PCM16 stream from `rate` to `to_rate`, piece by piece: soxr's streaming
    resampler in float, so a stream flushed at its end holds the same samples as resampling it
    whole at once."""

    def __init__(self, rate: int, to_rate: int) -> None:
        self.rate, self.to_rate = rate, to_rate
        self._stream: soxr.ResampleStream | None = None

    def feed(self, pcm16: bytes, last: bool = False) -> bytes:
        if self.rate == self.to_rate:
            return pcm16
        if self._stream is None:
            if last and not pcm16:
                return b""
            self._stream = soxr.ResampleStream(self.rate, self.to_rate, 1, dtype="float32")
        samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        out = self._stream.resample_chunk(samples, last=last)
        if last:
            self._stream = None
        return to_pcm16(out)

    def flush(self) -> bytes:
        """The samples still held back; the next piece begins a new stream."""
        return self.feed(b"", last=True)

    def reset(self) -> None:
        """Drop what is held back (the input was discarded)."""
        self._stream = None
