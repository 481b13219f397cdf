"""What a video stage can make, and the one check of a request against it.

The denoising stage knows its model's limits once it has loaded it (sizes in multiples of its
latent cell, lengths its VAE can make), and announces them in its heartbeat, so a gateway
refuses a video job it could not run (a 400 naming the field) before queueing it; the stage
runs the same check on every request it is sent.
"""

from __future__ import annotations

import msgspec


class ClipLimits(msgspec.Struct, frozen=True):
    multiple: int
    """Widths and heights are multiples of this many pixels..."""
    max_size: int
    """...up to this many."""
    fps: int
    """The frame rate a request that names none gets."""
    frames: int
    """The length, in frames, a request that names none gets."""
    max_frames: int
    frame_step: int
    """Lengths are `frame_step` k + 1 frames (a video VAE's temporal compression)."""


class ClipError(ValueError):
    """A request asks for what the model cannot make; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


MAX_FPS = 60


def check_size(width: int, height: int, multiple: int, max_size: int) -> None:
    m, top = multiple, max_size
    if not (m <= width <= top and m <= height <= top and width % m == 0 and height % m == 0):
        raise ClipError(
            "size",
            f"{width}x{height}: this model makes widths and heights that are multiples of {m}, "
            f"from {m} to {top}",
        )


def clip_frames(
    limits: ClipLimits, seconds: float | None, fps: int | None, num_frames: int | None
) -> tuple[int, int]:
    """The clip's frames and frame rate: `num_frames`, or `seconds` at `fps` rounded to a length
    the model makes, or its default length."""
    rate = fps or limits.fps
    if not 1 <= rate <= MAX_FPS:
        raise ClipError("fps", f"{rate}; from 1 to {MAX_FPS}")
    k, top = limits.frame_step, limits.max_frames
    if num_frames is not None:
        if num_frames % k != 1 % k or not 1 <= num_frames <= top:
            raise ClipError("num_frames", f"{num_frames}; this model makes {k}k + 1 frames, at most {top}")
        return num_frames, rate
    if seconds is None:
        return limits.frames, rate
    frames = k * round(seconds * rate / k) + 1
    if seconds <= 0 or frames > top:
        raise ClipError(
            "seconds", f"{seconds:g}; at {rate} fps this model makes at most {(top - 1) / rate:g} seconds"
        )
    return frames, rate
