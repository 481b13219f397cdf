"""A finished clip's files: the MP4 (H.264 through PyAV, at the clip's frame rate), a thumbnail
and a spritesheet (WebP), as OpenAI's `variant`s of a video's content name them.

Encoding runs in a worker thread (the caller's `asyncio.to_thread`): it takes long enough to
stall every other request on the event loop.
"""

from __future__ import annotations

import io
from typing import Final

import av
import numpy as np
from PIL import Image

MEDIA_TYPES: Final = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/webp"}
FILE_NAMES: Final = {"video": "video.mp4", "thumbnail": "thumbnail.webp", "spritesheet": "spritesheet.webp"}
SPRITES: Final = 8
"""Frames in a spritesheet, spread evenly over the clip, side by side."""
SPRITE_HEIGHT: Final = 90


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """uint8 frames [F, H, W, 3] -> an MP4 file (H.264, yuv420p, as browsers play it)."""
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 in yuv420p needs an even width and height, not {width}x{height}")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def encode_thumbnail(frames: np.ndarray) -> bytes:
    """The clip's first frame, as WebP."""
    buf = io.BytesIO()
    Image.fromarray(frames[0], "RGB").save(buf, format="WEBP", quality=90)
    return buf.getvalue()


def encode_spritesheet(frames: np.ndarray) -> bytes:
    """Up to SPRITES frames spread evenly over the clip, in one row, each SPRITE_HEIGHT high
    (or the clip's height, if smaller), as WebP."""
    picks = np.unique(np.linspace(0, len(frames) - 1, min(SPRITES, len(frames))).round().astype(int))
    height = min(SPRITE_HEIGHT, frames.shape[1])
    width = max(1, round(frames.shape[2] * height / frames.shape[1]))
    sheet = Image.new("RGB", (width * len(picks), height))
    for i, k in enumerate(picks):
        sheet.paste(Image.fromarray(frames[k], "RGB").resize((width, height)), (i * width, 0))
    buf = io.BytesIO()
    sheet.save(buf, format="WEBP", quality=85)
    return buf.getvalue()
