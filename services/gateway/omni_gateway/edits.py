"""POST /v1/images/edits: the body read (a multipart form, or OpenAI's JSON with image URLs),
its images and mask decoded and checked, and the mask honoured on what the model made.

The images become RGB pixels, uint8 [H, W, 3], as a chat's image parts do (media.py), and ride
to the source stage on the request's connector. A mask is OpenAI's: a PNG the size of the
first image whose fully transparent pixels mark where to edit. The model edits the whole
image; outside the mask the gateway puts the first image back (scaled to the output's size),
so only the masked part changes, in the previews of a stream as in the final images.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
from fastapi import Request
from PIL import Image
from starlette.datastructures import UploadFile

from omni_gateway.errors import BadRequest
from omni_gateway.events import Event, ImageProgress
from omni_gateway.media import Media, decode_image, url_bytes
from omni_gateway.protocol.common import json_object, parse
from omni_gateway.protocol.images import ImageEditRequest
from omni_pipeline.settings import MediaSpec

IMAGE_FIELDS: Final = ("image", "image[]")
"""The form's names for the images to edit (the openai SDK sends a list as `image[]`)."""


@dataclass
class EditInputs:
    """An edit's decoded files: the images by reference, and where the mask lets it change."""

    media: Media
    first: np.ndarray
    """The first image, RGB [H, W, 3]: what the mask keeps."""
    editable: np.ndarray | None = None
    """bool [H, W]: True where the mask is fully transparent (None: no mask, all of it)."""

    @property
    def references(self) -> list[str]:
        return list(self.media.tensors)

    async def kept(self, ev: Event) -> Event:
        """The event with its images kept to the mask's transparent part (the first image
        elsewhere); as it is without a mask."""
        if self.editable is None or not isinstance(ev, ImageProgress) or not ev.images:
            return ev
        return replace(ev, images=await asyncio.to_thread(_composite, ev.images, self.first, self.editable))

    async def all_kept(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        async for ev in events:
            yield await self.kept(ev)


async def read_edit_request(request: Request, limits: MediaSpec) -> tuple[ImageEditRequest, EditInputs]:
    """The body as an ImageEditRequest and its images decoded; a 400 names the field at fault.
    A multipart form (`image` files, a `mask` file), or OpenAI's JSON (`images` and `mask` as
    image references: how a batch line asks for an edit)."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        fields, uploads, mask = await _form_parts(request, limits)
    else:
        fields, uploads, mask = await _json_parts(request, limits)
    req: ImageEditRequest = parse(ImageEditRequest, fields)
    if not uploads:
        raise BadRequest("image: an edit needs an image to edit", param="image")
    if len(uploads) > limits.max_parts:
        raise BadRequest(f"image: more than {limits.max_parts} images in one request", param="image")
    media = Media()
    first: np.ndarray | None = None
    for key, data in uploads:
        try:
            pixels = await asyncio.to_thread(decode_image, data, limits.max_image_pixels)
        except ValueError as exc:
            raise BadRequest(f"{key}: {exc}", param=key) from None
        media.add(pixels)
        first = pixels.numpy() if first is None else first
    assert first is not None
    edit = EditInputs(media, first)
    if mask is not None:
        edit.editable = await asyncio.to_thread(_editable, mask, first.shape[:2], limits.max_image_pixels)
    return req, edit


Parts = tuple[dict[str, Any], list[tuple[str, bytes]], bytes | None]
"""An edit body's fields, its images' bytes (each by the name a 400 gives it) and its mask's."""


async def _form_parts(request: Request, limits: MediaSpec) -> Parts:
    fields: dict[str, Any] = {}
    uploads: list[tuple[str, bytes]] = []
    mask: bytes | None = None
    async with request.form(max_files=limits.max_parts + 1) as form:
        for key, value in form.multi_items():
            if key in IMAGE_FIELDS or key == "mask":
                if not isinstance(value, UploadFile):
                    raise BadRequest(f"{key}: must be a file", param=key)
                data = await value.read()
                _within(len(data), key, limits)
                if key == "mask":
                    if mask is not None:
                        raise BadRequest("mask: given more than once", param="mask")
                    mask = data
                else:
                    uploads.append((key, data))
            elif key in fields:
                raise BadRequest(f"{key}: given more than once", param=key)
            elif isinstance(value, UploadFile):
                raise BadRequest(f"{key}: must be a form field, not a file", param=key)
            else:
                fields[key] = value
    return fields, uploads, mask


async def _json_parts(request: Request, limits: MediaSpec) -> Parts:
    """OpenAI's JSON edit: `images`, a list of `{"image_url": ...}` (a data: URL, or http(s)
    where the gateway fetches), and `mask` as one of them. `file_id` references are refused:
    files here are batches' input, not images."""
    fields = await json_object(request, "the body is neither JSON nor a multipart form")
    images = fields.pop("images", None)
    if images is not None and not isinstance(images, list):
        raise BadRequest("images: must be a list of image references", param="images")
    if images is not None and len(images) > limits.max_parts:  # before any is fetched
        raise BadRequest(f"images: more than {limits.max_parts} images in one request", param="images")
    uploads = [
        (f"images[{i}]", await _referenced(ref, f"images[{i}]", limits)) for i, ref in enumerate(images or [])
    ]
    mask_ref = fields.pop("mask", None)
    mask = None if mask_ref is None else await _referenced(mask_ref, "mask", limits)
    return fields, uploads, mask


async def _referenced(ref: Any, where: str, limits: MediaSpec) -> bytes:
    """An `ImageRefParam`'s bytes: exactly one of `image_url` and `file_id`, and only the first
    is served."""
    if not isinstance(ref, dict) or set(ref) - {"image_url", "file_id"} or len(ref) != 1:
        raise BadRequest(f"{where}: an object with one of image_url or file_id", param=where)
    if "file_id" in ref:
        raise BadRequest(
            f"{where}.file_id: uploaded files are not image inputs here; send image_url (a data: URL)",
            param=f"{where}.file_id",
        )
    url = ref["image_url"]
    try:
        if not isinstance(url, str):
            raise ValueError("must be a URL")
        data = await url_bytes(url, limits)
    except ValueError as exc:
        raise BadRequest(f"{where}.image_url: {exc}", param=f"{where}.image_url") from None
    _within(len(data), where, limits)
    return data


def _within(size: int, key: str, limits: MediaSpec) -> None:
    if size > limits.max_image_bytes:
        raise BadRequest(f"{key}: {size} bytes, more than the limit of {limits.max_image_bytes}", param=key)


def _editable(data: bytes, size: tuple[int, ...], max_pixels: int) -> np.ndarray:
    """Where the mask's alpha is 0, bool [H, W]; a 400 for a mask that is not a PNG with an
    alpha channel the first image's size."""
    try:
        decode_image(data, max_pixels)  # an image's checks first: format, size, corruption
        img = Image.open(io.BytesIO(data))
        if img.format != "PNG":
            raise ValueError(f"must be a PNG with an alpha channel, not {img.format}")
        rgba = img.convert("RGBA") if "A" in img.getbands() or "transparency" in img.info else None
    except ValueError as exc:
        raise BadRequest(f"mask: {exc}", param="mask") from None
    if rgba is None:
        raise BadRequest(
            "mask: has no alpha channel (its fully transparent pixels mark where to edit)", param="mask"
        )
    if (rgba.height, rgba.width) != tuple(size):
        raise BadRequest(
            f"mask: {rgba.width}x{rgba.height}, not the size of the image ({size[1]}x{size[0]})", param="mask"
        )
    return np.asarray(rgba)[:, :, 3] == 0


def _composite(images: list[np.ndarray], first: np.ndarray, editable: np.ndarray) -> list[np.ndarray]:
    h, w = images[0].shape[:2]
    if (h, w) != first.shape[:2]:
        first = np.asarray(Image.fromarray(first).resize((w, h), Image.Resampling.BICUBIC))
        editable = np.asarray(Image.fromarray(editable).resize((w, h), Image.Resampling.NEAREST))
    where = editable[:, :, None]
    return [np.where(where, img, first) for img in images]
