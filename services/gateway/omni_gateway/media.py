"""Media input parts of a chat request, checked and decoded once, here, for any model.

The gateway knows no model's processor. It turns each part into what every processor starts
from (an image into RGB pixels, uint8 [H, W, 3]; audio into mono float32 PCM at the clip's
own rate; a video into RGB frames, uint8 [T, H, W, 3], taken at `videoFps` as Qwen's and
vLLM's video loaders sample them, with the rate they were taken at) and leaves resizing,
resampling and feature extraction to the source stage's engine. The tensors travel on the
request edge's connector, never as base64 on NATS: the messages keep, in place of each part, a
reference to its tensor (`{"type": "image", "media": "m0"}`, `{"type": "audio", "media": "m1",
"sample_rate": 16000}`, `{"type": "video", "media": "m2", "fps": 2.0}`).

Every failure is a 400 that names the part (`messages[1].content[2]`) and says why: not
base64, not decodable, truncated, an unsupported format, over a limit of `spec.gateway.media`,
a URL while fetching is off.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import math
import ssl
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote_to_bytes, urlsplit

import av
import httpx
import numpy as np
import soundfile
import torch
from PIL import Image, UnidentifiedImageError

from omni_gateway.errors import BadRequest
from omni_pipeline.settings import MediaSpec

AUDIO_FORMATS: Final = {"wav": ("WAV", "WAVEX", "RF64"), "flac": ("FLAC",), "mp3": ("MP3",)}
"""`input_audio.format` values served, and the containers libsndfile may find in the data."""
IMAGE_FORMATS: Final = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
_RIFF_UNKNOWN_SIZE: Final = 0xFFFFFFFF
"""What a streaming WAV writer (ours included) puts where it cannot know the size yet."""


@dataclass
class Media:
    """A request's decoded media: the tensors by reference, for the source stages' connector."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, tensor: torch.Tensor) -> str:
        key = f"m{len(self.tensors)}"
        self.tensors[key] = tensor
        return key


_PART_KINDS: Final = {"image_url": "image", "input_audio": "audio", "video_url": "video"}
"""OpenAI's content part types -> the kinds engines declare they read (`Engine.accepts`)."""


async def decode_media(
    messages: list[dict[str, Any]], limits: MediaSpec, accepts: frozenset[str] | None = None
) -> tuple[list[dict[str, Any]], Media]:
    """The messages with each media part replaced by a reference, and the tensors referred to.
    `accepts`: the part kinds the model reads (None: unknown); any other is refused first."""
    media = Media()
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if accepts is not None and kind in _PART_KINDS and _PART_KINDS[kind] not in accepts:
                reads = ", ".join(sorted(accepts))
                raise BadRequest(
                    f"{where}: this model cannot read {kind} parts; it reads {reads}", param=where
                )
            if len(media.tensors) == limits.max_parts:
                raise BadRequest(
                    f"{where}: more than {limits.max_parts} media parts in one request", param=where
                )
            try:
                if kind == "image_url":
                    data = await url_bytes(part["image_url"]["url"], limits)
                    pixels = await asyncio.to_thread(decode_image, data, limits.max_image_pixels)
                    parts.append({"type": "image", "media": media.add(pixels)})
                elif kind == "input_audio":
                    audio = part["input_audio"]
                    data = _base64(audio["data"])
                    pcm, rate = await asyncio.to_thread(
                        decode_audio, data, audio["format"], limits.max_audio_seconds
                    )
                    parts.append({"type": "audio", "media": media.add(pcm), "sample_rate": rate})
                elif kind == "video_url":
                    data = await url_bytes(part["video_url"]["url"], limits)
                    frames, fps = await asyncio.to_thread(decode_video, data, limits)
                    parts.append({"type": "video", "media": media.add(frames), "fps": fps})
                else:
                    raise ValueError(
                        f"'{kind}' parts are not served (image_url, input_audio and video_url are)"
                    )
            except ValueError as exc:
                raise BadRequest(f"{where} ({kind}): {exc}", param=where) from None
        out.append({**msg, "content": parts})
    return out, media


async def decode_clip(value: str, limits: MediaSpec) -> tuple[torch.Tensor, int]:
    """A voice's clip (a speech request's `ref_audio`): a data: URL, bare base64, or an http(s)
    URL where fetching is on; mono float32 PCM and its rate, as an `input_audio` part decodes.
    A file:// URL or a path is refused: a client never reads the server's disk. Any failure is
    a 400 naming `ref_audio`."""
    try:
        scheme = urlsplit(value).scheme
        if scheme == "file" or value.startswith(("/", "./", "../", "~")):
            raise ValueError("a file path names the server's disk, which no client reads; send a data: URL")
        data = await url_bytes(value, limits) if scheme in ("data", "http", "https") else _base64(value)
        return await asyncio.to_thread(decode_audio, data, None, limits.max_audio_seconds)
    except ValueError as exc:
        raise BadRequest(f"ref_audio: {exc}", param="ref_audio") from None


def decode_image(data: bytes, max_pixels: int) -> torch.Tensor:
    """RGB pixels [H, W, 3] uint8. The size is checked from the header, before decoding."""
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own ceiling, far above any sane limit
        raise ValueError(f"more pixels than the limit of {max_pixels} ({exc})") from None
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"not an image (one of {', '.join(sorted(IMAGE_FORMATS))})") from None
    if img.format not in IMAGE_FORMATS:
        raise ValueError(f"{img.format} images are not served ({', '.join(sorted(IMAGE_FORMATS))} are)")
    w, h = img.size
    if w * h > max_pixels:
        raise ValueError(f"{w}x{h} is {w * h} pixels, more than the limit of {max_pixels}")
    try:
        rgb = img.convert("RGB")  # decodes; a truncated or corrupt file fails here
    except Exception as exc:  # whatever the decoder raises on client data is the client's error
        raise ValueError(f"the {img.format} data is corrupt or truncated ({exc})") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


def decode_audio(data: bytes, fmt: str | None, max_seconds: float) -> tuple[torch.Tensor, int]:
    """Mono float32 PCM [samples] in [-1, 1], and its sample rate. `fmt`: the format the client
    named (None: any served one, as the data says). The length is checked from the header,
    before decoding. A WAV file shorter than its RIFF header says is truncated (libsndfile
    would quietly read what is there)."""
    if fmt is not None and fmt not in AUDIO_FORMATS:
        raise ValueError(f"format '{fmt}' is not served (use {', '.join(AUDIO_FORMATS)})")
    containers = AUDIO_FORMATS[fmt] if fmt else tuple(c for cs in AUDIO_FORMATS.values() for c in cs)
    size = int.from_bytes(data[4:8], "little") + 8 if data[:4] == b"RIFF" else 0
    if len(data) < size and size != _RIFF_UNKNOWN_SIZE + 8:
        raise ValueError(f"truncated: {len(data)} bytes of the {size} its RIFF header announces")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.format not in containers:
                raise ValueError(f"the data is {f.format}, not {fmt or ' or '.join(AUDIO_FORMATS)}")
            rate, frames = f.samplerate, f.frames
            if frames / rate > max_seconds:
                raise ValueError(f"{frames / rate:.1f} s of audio, more than the limit of {max_seconds:g} s")
            pcm = f.read(dtype="float32", always_2d=True)
    except ValueError:
        raise
    except Exception:  # libsndfile's errors, and whatever else its decoders raise on client data
        raise ValueError(f"not decodable as {fmt}: corrupt, truncated or another format") from None
    if len(pcm) < frames:
        raise ValueError(f"truncated: {len(pcm)} of the {frames} samples its header announces")
    if len(pcm) == 0:
        raise ValueError("no samples")
    return torch.from_numpy(np.ascontiguousarray(pcm.mean(axis=1, dtype=np.float32))), rate


def decode_video(data: bytes, limits: MediaSpec) -> tuple[torch.Tensor, float]:
    """RGB frames [T, H, W, 3] uint8 taken at `limits.video_fps` (each frame the first at or
    after its time; a video with fewer frames a second keeps all of its own), and the rate
    they were taken at. Frame size and, where the container says, length are checked before
    decoding; a stream that ends more than a frame before the length its header gives (or the
    frames it counts) is truncated. The video's own audio track is not read."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise _Refused("no video stream in the data")
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            _check_frame_size(w, h, limits)
            own = float(stream.average_rate or stream.guessed_rate or 0)
            fps = min(limits.video_fps, own) if own > 0 else limits.video_fps
            # The video's own length; the container's only where the video is all it holds (an
            # audio track may run longer).
            seconds: float | None = None
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration and len(container.streams) == 1:
                seconds = container.duration / av.time_base
            if seconds is not None and w * h:
                _check_video_size(math.ceil(seconds * fps - 1e-6), w, h, fps, limits)
            frames: list[np.ndarray] = []
            decoded, start, t = 0, 0.0, 0.0
            for frame in container.decode(stream):
                t = frame.time if frame.time is not None else decoded / (own or fps)
                start = t if decoded == 0 else start
                decoded += 1
                if t - start < len(frames) / fps - 1e-6:
                    continue
                if not frames and not w * h:  # a header that did not say: the first frame does
                    w, h = frame.width, frame.height
                    _check_frame_size(w, h, limits)
                if (frame.width, frame.height) != (w, h):
                    raise _Refused(f"the frame size changes from {w}x{h} to {frame.width}x{frame.height}")
                _check_video_size(len(frames) + 1, w, h, fps, limits)
                frames.append(frame.to_ndarray(format="rgb24"))
            if stream.frames and decoded < stream.frames:
                raise _Refused(f"truncated: {decoded} of the {stream.frames} frames its header announces")
            if own and seconds is not None and decoded and t - start + 2 / own < seconds:
                raise _Refused(
                    f"truncated: {t - start + 1 / own:.2f} s of the {seconds:.2f} s its header announces"
                )
    except _Refused as exc:
        raise ValueError(str(exc)) from None
    except Exception:  # FFmpeg's errors (some are ValueErrors), and whatever else its decoders raise
        raise ValueError("not decodable as a video: corrupt, truncated or an unknown format") from None
    if not frames:
        raise ValueError("no frames: the data is truncated, or its video is empty")
    return torch.from_numpy(np.stack(frames)), fps


class _Refused(Exception):
    """What `decode_video` says of the data itself, apart from what FFmpeg raises on it."""


def _check_frame_size(w: int, h: int, limits: MediaSpec) -> None:
    if w * h > limits.max_image_pixels:
        raise _Refused(f"{w}x{h} frames are {w * h} pixels, more than the limit of {limits.max_image_pixels}")


def _check_video_size(frames: int, w: int, h: int, fps: float, limits: MediaSpec) -> None:
    if frames > limits.max_video_frames:
        raise _Refused(
            f"{frames} frames at {fps:g} a second, more than the limit of {limits.max_video_frames}"
        )
    if frames * w * h > limits.max_video_pixels:
        raise _Refused(
            f"{frames} frames of {w}x{h} are {frames * w * h} pixels, more than the limit of "
            f"{limits.max_video_pixels}"
        )


def _base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("data is not base64") from None


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS context media fetches share: building one (certifi's CAs loaded) takes 25 ms of
    CPU, which a client made per fetch would take from the gateway's loop every time."""
    return httpx.create_ssl_context()


async def url_bytes(url: str, limits: MediaSpec) -> bytes:
    """A data: URL's bytes, or an http(s) URL's body when fetching is on (within its limits)."""
    if url.startswith("data:"):
        head, sep, body = url[5:].partition(",")
        if not sep:
            raise ValueError("a data: URL needs a ',' before its data")
        return _base64(body) if head.endswith(";base64") else unquote_to_bytes(body)
    scheme = urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise ValueError("the URL must be a data: URL or http(s)")
    if not limits.fetch_urls:
        raise ValueError("this server does not fetch URLs (spec.gateway.media.fetchUrls); send a data: URL")
    body = bytearray()
    try:
        async with (
            asyncio.timeout(limits.fetch_timeout_s),
            httpx.AsyncClient(verify=_tls()) as client,
            client.stream("GET", url) as r,
        ):
            if r.status_code != 200:
                raise ValueError(f"fetching {url} answered {r.status_code}")
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > limits.fetch_max_bytes:
                    raise ValueError(f"{url} is larger than the limit of {limits.fetch_max_bytes} bytes")
    except TimeoutError:
        raise ValueError(f"fetching {url} took longer than {limits.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise ValueError(f"fetching {url} failed: {exc}") from None
    return bytes(body)
