"""Image generations: pipeline events -> OpenAI's images response, whole or as SSE events.

Encoding runs in a worker thread: a large PNG takes long enough to stall every other stream.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import numpy as np
from PIL import Image

from omni_gateway.errors import StageFailed, error_from
from omni_gateway.events import Event, Finished, ImageProgress
from omni_gateway.protocol.images import ImageEditRequest, ImageGenerationRequest

_PIL_FORMATS: Final = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(rgb: np.ndarray, output_format: str, compression: int | None = None) -> bytes:
    """One RGB array [height, width, 3] uint8 -> the file bytes of `output_format`."""
    options: dict[str, Any] = {}
    if output_format != "png" and compression is not None:
        options["quality"] = 100 - compression
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format=_PIL_FORMATS[output_format], **options)
    return buf.getvalue()


async def encoded(req: ImageGenerationRequest, ev: ImageProgress) -> list[str]:
    """The event's images, each encoded as the request asks and in base64."""

    def run() -> list[str]:
        return [
            base64.b64encode(encode_image(img, req.output_format, req.output_compression)).decode()
            for img in ev.images
        ]

    return await asyncio.to_thread(run)


def size_of(ev: ImageProgress) -> str:
    h, w = ev.images[0].shape[:2]
    return f"{w}x{h}"


def image_usage(f: Finished) -> dict[str, Any]:
    """OpenAI's image usage: the prompt's text tokens (as the text encoder counted them); a
    diffusion model makes no image tokens."""
    return {
        "total_tokens": f.prompt_tokens,
        "input_tokens": f.prompt_tokens,
        "output_tokens": 0,
        "input_tokens_details": {"text_tokens": f.prompt_tokens, "image_tokens": 0},
    }


def final_images(events: list[Event]) -> tuple[ImageProgress, Finished]:
    final = next((ev for ev in events if isinstance(ev, ImageProgress) and ev.is_last), None)
    if final is None:
        raise StageFailed("the pipeline ended without a final image")
    return final, next((ev for ev in events if isinstance(ev, Finished)), Finished("stop", {}))


async def images_body(
    req: ImageGenerationRequest, created: int, final: ImageProgress, finished: Finished
) -> dict[str, Any]:
    return {
        "created": created,
        "data": [{"b64_json": b64} for b64 in await encoded(req, final)],
        "output_format": req.output_format,
        "size": size_of(final),
        "usage": image_usage(finished),
    }


def _sse(kind: str, obj: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def image_stream(
    req: ImageGenerationRequest, created: int, first: Event, events: AsyncIterator[Event]
) -> AsyncIterator[str]:
    """OpenAI's image stream: `image_generation.partial_image` per preview and image, then
    `image_generation.completed` per image (`index` says which of n), held until the request's
    end brings the usage they carry; an edit's are `image_edit.*`. A failure mid-stream becomes
    an `error` event."""
    what = "image_edit" if isinstance(req, ImageEditRequest) else "image_generation"
    partial = 0
    completed: list[dict[str, Any]] = []
    try:
        ev: Event | None = first
        while ev is not None:
            if isinstance(ev, Finished):
                for body in completed:
                    yield _sse(body["type"], {**body, "usage": image_usage(ev)})
            elif isinstance(ev, ImageProgress):
                kind = f"{what}.completed" if ev.is_last else f"{what}.partial_image"
                for i, b64 in enumerate(await encoded(req, ev)):
                    body: dict[str, Any] = {
                        "type": kind,
                        "b64_json": b64,
                        "created_at": created,
                        "size": size_of(ev),
                        "quality": "auto",
                        "background": "opaque",
                        "output_format": req.output_format,
                        "index": i,
                    }
                    if ev.is_last:
                        completed.append(body)
                    else:
                        body["partial_image_index"] = partial
                        yield _sse(kind, body)
                if not ev.is_last:
                    partial += 1
            ev = await anext(events, None)
    except Exception as exc:
        yield _sse("error", {"type": "error", **error_from(exc).body()})
