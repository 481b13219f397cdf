"""The gateway's media decoding (omni_gateway.media): real files made here with soundfile,
Pillow and PyAV, decoded to what every model's processor starts from; every bad part a 400 that names
the part and why. URL fetching against a real HTTP server on localhost."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omni_gateway.errors import BadRequest
from omni_gateway.media import decode_clip, decode_media
from omni_pipeline.settings import MediaSpec
from tests.helpers import video_file

RATE = 16000


def clip(seconds: float = 0.5, channels: int = 1, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono, -0.5 * mono], axis=1)


def audio_file(samples: np.ndarray, fmt: str, rate: int = RATE, **kw: Any) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, **kw)
    return out.getvalue()


def image_file(w: int, h: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (w, h), color=120 if mode == "L" else (10, 200, 30)).save(out, format=fmt)
    return out.getvalue()


def audio_part(data: bytes | str, fmt: str) -> dict[str, Any]:
    b64 = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": b64, "format": fmt}}


def data_url(url_or_data: bytes | str, mime: str) -> str:
    """A URL as given, or the bytes as a data: URL."""
    if isinstance(url_or_data, str):
        return url_or_data
    return f"data:{mime};base64,{base64.b64encode(url_or_data).decode()}"


def image_part(url_or_data: bytes | str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(url_or_data, "image/png")}}


def frames(n: int, h: int = 16, w: int = 24) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def video_part(url_or_data: bytes | str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": data_url(url_or_data, "video/x-matroska")}}


def decode(*parts: dict[str, Any], limits: MediaSpec | None = None) -> tuple[list[dict[str, Any]], Any]:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, *parts]},
    ]
    return asyncio.run(decode_media(messages, limits or MediaSpec()))


def test_parts_become_references_to_tensors_every_model_can_start_from() -> None:
    stereo_44k = clip(0.25, channels=2, rate=44100)
    messages, media = decode(
        audio_part(audio_file(clip(), "WAV", subtype="FLOAT"), "wav"),
        image_part(image_file(30, 20)),
        audio_part(audio_file(stereo_44k, "FLAC", rate=44100), "flac"),
        image_part(image_file(8, 6, "JPEG", mode="L")),
        audio_part(audio_file(clip(), "MP3"), "mp3"),
    )
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1]["content"] == [
        {"type": "text", "text": "look:"},
        {"type": "audio", "media": "m0", "sample_rate": RATE},
        {"type": "image", "media": "m1"},
        {"type": "audio", "media": "m2", "sample_rate": 44100},
        {"type": "image", "media": "m3"},
        {"type": "audio", "media": "m4", "sample_rate": RATE},
    ]
    t = media.tensors
    assert torch.equal(t["m0"], torch.from_numpy(clip()))  # float WAV: lossless
    assert t["m1"].shape == (20, 30, 3) and t["m1"].dtype == torch.uint8
    assert t["m1"][0, 0].tolist() == [10, 200, 30]
    # FLAC stores 16 bits; the two channels are averaged (mono, as librosa loads it).
    expected = torch.from_numpy(stereo_44k.mean(axis=1))
    torch.testing.assert_close(t["m2"], expected, rtol=0, atol=2 / 32768)
    assert t["m3"].shape == (6, 8, 3) and t["m3"][0, 0].tolist() == [120, 120, 120]  # grey -> RGB
    assert t["m4"].dtype == torch.float32 and abs(len(t["m4"]) - RATE // 2) < 1200  # MP3's padding
    assert float(t["m4"].abs().max()) > 0.3


def test_a_video_becomes_its_frames_taken_at_the_specs_rate() -> None:
    """10 fps for 2 s, taken at 2 a second: frames 0, 5, 10, 15 exactly (a lossless codec). A
    video slower than the rate keeps every frame, at its own rate."""
    fast, slow = frames(20), frames(3)
    messages, media = decode(video_part(video_file(fast, 10)), video_part(video_file(slow, 1)))
    assert messages[1]["content"][1:] == [
        {"type": "video", "media": "m0", "fps": 2.0},
        {"type": "video", "media": "m1", "fps": 1.0},
    ]
    assert media.tensors["m0"].dtype == torch.uint8
    assert torch.equal(media.tensors["m0"], torch.from_numpy(fast[::5]))
    assert torch.equal(media.tensors["m1"], torch.from_numpy(slow))
    _, media = decode(video_part(video_file(fast, 10)), limits=MediaSpec(video_fps=5))
    assert torch.equal(media.tensors["m0"], torch.from_numpy(fast[::2]))
    # An audio track longer than the video: the video is whole (its audio is not read).
    _, media = decode(video_part(video_file(fast, 10, audio_seconds=4.0)))
    assert torch.equal(media.tensors["m0"], torch.from_numpy(fast[::5]))


def wav_bytes() -> bytes:
    return audio_file(clip(), "WAV")


def png_header(w: int, h: int) -> bytes:
    """A PNG that is only its header: a size and no pixels (what a decompression bomb shows)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "audio-not-base64": (audio_part("bm90 IGJhc2U2NA*=", "wav"), "data is not base64"),
    "image-not-base64": (image_part("data:image/png;base64,%%%"), "data is not base64"),
    "truncated-wav": (
        audio_part(wav_bytes()[:5000], "wav"),
        "truncated: 5000 bytes of the 16044 its RIFF header announces",
    ),
    "not-audio": (audio_part(b"just some text, no audio", "wav"), "not decodable as wav"),
    "unsupported-format": (audio_part(wav_bytes(), "ogg"), "format 'ogg' is not served (use wav, flac, mp3)"),
    "format-mismatch": (audio_part(audio_file(clip(), "FLAC"), "wav"), "the data is FLAC, not wav"),
    "truncated-png": (image_part(image_file(64, 64)[:60]), "corrupt or truncated"),
    "not-an-image": (image_part(b"GIF89a but not really"), "not an image"),
    "huge-image": (image_part(png_header(5000, 5000)), "5000x5000 is 25000000 pixels, more than the limit"),
    "bomb": (image_part(png_header(30000, 30000)), "more pixels than the limit of 16777216"),
    "unsupported-image": (image_part(image_file(4, 4, "TIFF")), "TIFF images are not served"),
    "url-while-fetching-is-off": (
        image_part("https://example.com/cat.png"),
        "this server does not fetch URLs (spec.gateway.media.fetchUrls)",
    ),
    "file-url": (image_part("file:///etc/passwd"), "the URL must be a data: URL or http(s)"),
    "video-not-base64": (video_part("data:video/mp4;base64,%%%"), "data is not base64"),
    "truncated-video": (video_part(video_file(frames(8), 4)[:9000]), "s of the 2.00 s its header announces"),
    "not-a-video": (video_part(b"\x1aE\xdf\xa3 not matroska at all"), "not decodable as a video"),
    "audio-as-video": (video_part(wav_bytes()), "no video stream in the data"),
    "video-url-while-fetching-is-off": (
        video_part("https://example.com/clip.mp4"),
        "this server does not fetch URLs (spec.gateway.media.fetchUrls)",
    ),
    "input-video": (
        {"type": "input_video", "input_video": {"data": "eA=="}},
        "'input_video' parts are not served",
    ),
    "file": ({"type": "file", "file": {"file_data": "eA=="}}, "'file' parts are not served"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_part_is_a_400_naming_it(case: str) -> None:
    part, says = BAD[case]
    with pytest.raises(BadRequest) as err:
        decode(part)
    kind = part["type"]
    assert err.value.param == "messages[1].content[1]"
    assert err.value.message.startswith(f"messages[1].content[1] ({kind}): "), err.value.message
    assert says in err.value.message, err.value.message


def test_each_limit_is_a_400_checked_before_decoding() -> None:
    limits = MediaSpec(max_parts=2, max_audio_seconds=1.0, max_image_pixels=100 * 100)
    with pytest.raises(BadRequest, match=r"content\[3\]: more than 2 media parts"):
        decode(
            image_part(image_file(2, 2)),
            image_part(image_file(2, 2)),
            image_part(image_file(2, 2)),
            limits=limits,
        )
    # Silence compresses to almost nothing: only the header's length can stop it.
    long = audio_file(np.zeros(RATE * 60, np.float32), "FLAC")
    assert len(long) < 20000
    with pytest.raises(BadRequest, match=r"60\.0 s of audio, more than the limit of 1 s"):
        decode(audio_part(long, "flac"), limits=limits)
    big = image_file(101, 100)
    with pytest.raises(BadRequest, match="101x100 is 10100 pixels, more than the limit of 10000"):
        decode(image_part(big), limits=limits)
    decode(image_part(image_file(100, 100)), audio_part(audio_file(clip(1.0), "WAV"), "wav"), limits=limits)
    # Video: each frame within the image limit; the frames taken, and all their pixels, within
    # theirs (from the header's length where it has one).
    video = video_file(frames(8, 10, 20), 4)  # 2 s: 4 frames at 2 a second, 200 pixels each
    with pytest.raises(BadRequest, match="20x10 frames are 200 pixels, more than the limit of 100"):
        decode(video_part(video), limits=MediaSpec(max_image_pixels=100))
    with pytest.raises(BadRequest, match="4 frames at 2 a second, more than the limit of 3"):
        decode(video_part(video), limits=MediaSpec(max_video_frames=3))
    with pytest.raises(BadRequest, match="4 frames of 20x10 are 800 pixels, more than the limit of 799"):
        decode(video_part(video), limits=MediaSpec(max_video_pixels=799))
    decode(
        video_part(video), limits=MediaSpec(max_image_pixels=200, max_video_frames=4, max_video_pixels=800)
    )


class _Files(http.server.BaseHTTPRequestHandler):
    """Serves /cat.png, a large /big.png, /clip.mkv, a 404 elsewhere, and /stall, which answers only
    when the test ends (for the time limit)."""

    stalled = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/stall":
            self.stalled.wait(30)
            return
        body = {
            "/cat.png": image_file(12, 10),
            "/big.png": image_file(400, 400, "BMP"),
            "/clip.mkv": video_file(frames(2), 2),
            "/voice.flac": audio_file(clip(0.25), "FLAC"),
        }.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _Files.stalled.set()
        server.shutdown()
        server.server_close()


def test_urls_are_fetched_only_when_allowed_and_within_limits(files: str) -> None:
    limits = MediaSpec(fetch_urls=True, fetch_timeout_s=0.5, fetch_max_bytes=100_000)
    _, media = decode(image_part(f"{files}/cat.png"), video_part(f"{files}/clip.mkv"), limits=limits)
    assert media.tensors["m0"].shape == (10, 12, 3)
    assert torch.equal(media.tensors["m1"], torch.from_numpy(frames(2)))
    for path, says in {
        "/big.png": "is larger than the limit of 100000 bytes",
        "/nothing.png": "answered 404",
        "/stall": "took longer than 0.5 s",
    }.items():
        with pytest.raises(BadRequest, match=says):
            decode(image_part(f"{files}{path}"), limits=limits)
    with pytest.raises(BadRequest, match="does not fetch URLs"):
        decode(image_part(f"{files}/cat.png"))


def test_a_voices_clip_comes_as_a_data_url_base64_or_a_fetch_never_from_disk(files: str) -> None:
    """A speech request's `ref_audio`: any served audio format, as the data says; a file:// URL or
    a path is refused whether or not the file exists (the server's disk is not the client's)."""
    wav = audio_file(clip(), "WAV", subtype="PCM_16")
    for value in (data_url(wav, "audio/wav"), base64.b64encode(wav).decode()):
        pcm, rate = asyncio.run(decode_clip(value, MediaSpec()))
        assert rate == RATE and pcm.shape == (RATE // 2,)
        np.testing.assert_allclose(pcm.numpy(), clip(), atol=1 / 32768)
    fetching = MediaSpec(fetch_urls=True, fetch_timeout_s=5)
    pcm, rate = asyncio.run(decode_clip(f"{files}/voice.flac", fetching))
    assert (rate, pcm.shape) == (RATE, (RATE // 4,))
    for value, says in {
        f"{files}/voice.flac": "does not fetch URLs",
        "file:///etc/hostname": "names the server's disk",
        "/etc/hostname": "names the server's disk",
        "../models/clip.wav": "names the server's disk",
        base64.b64encode(b"not audio at all").decode(): "not decodable",
        data_url(audio_file(clip(2.0), "WAV"), "audio/wav"): "more than the limit of 1 s",
    }.items():
        with pytest.raises(BadRequest, match=says) as exc:
            asyncio.run(decode_clip(value, MediaSpec(max_audio_seconds=1)))
        assert exc.value.param == "ref_audio"
