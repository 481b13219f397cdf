"""A voice cloned end to end: `omni serve examples/qwen3-tts.yaml` (the tiny Base checkpoint), the
official openai client's `audio.speech.create` with vLLM-Omni's `ref_audio` (a data: URL of a WAV
clip), `ref_text` and `x_vector_only_mode`, and voices uploaded (POST /v1/audio/voices), against
the reference: the `qwen-tts` package's own `generate_voice_clone`, greedy, same checkpoint, clip
and text (tests/qwen_tts_reference.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile
import yaml

from omni_cli.natsd import EmbeddedNats
from tests.deployment import deployed
from tests.helpers import HTTP, ROOT, served
from tests.qwen_tts_reference import pcm16, qwen_tts_reference, same_speech, spoken_on_socket, waveform

pytestmark = pytest.mark.slow

CODES = 8
"""The talker's budget here (frames: 0.64 s of audio)."""
SAID = "Hello there, how are you?"
TRANSCRIPT = "This is my voice."
RATE = 16000


def clip() -> np.ndarray:
    """A voice-like clip at 16 kHz (the model's 24 kHz after resampling): 0.8 s."""
    t = np.arange(int(RATE * 0.8)) / RATE
    pitch = 2 * np.pi * (150 + 50 * t) * t
    noise = np.random.default_rng(5).standard_normal(t.shape)
    return (0.3 * np.sin(pitch) + 0.1 * np.sin(3 * pitch) + 0.02 * noise).astype(np.float32)


def data_url(wav: np.ndarray) -> str:
    """The clip as a client sends it: a 16-bit WAV in a data: URL."""
    buf = io.BytesIO()
    soundfile.write(buf, wav, RATE, subtype="PCM_16", format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


CLIP = clip()
HEARD = soundfile.read(io.BytesIO(base64.b64decode(data_url(CLIP).split(",", 1)[1])), dtype="float32")[0]
"""The clip as the gateway decodes it (16-bit: what the reference is given too)."""


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen3-tts.yaml, with a short budget."""
    pipeline = base_pipeline(demo_dir, "qwen3-tts-base")
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, url):
        yield url


def base_pipeline(demo_dir: Path, name: str) -> Path:
    """examples/qwen3-tts.yaml (Base) as pipeline `name` (its voices its own), a short budget."""
    example = (ROOT / "examples" / "qwen3-tts.yaml").read_text()
    assert "sampling: {max_tokens: 64}" in example and example.count("./models/tiny-qwen3-tts-base\n") == 2
    assert "metadata: {name: qwen3-tts}" in example
    pipeline = demo_dir / f"{name}.yaml"
    pipeline.write_text(
        example.replace("sampling: {max_tokens: 64}", f"sampling: {{max_tokens: {CODES + 1}}}").replace(
            "metadata: {name: qwen3-tts}", f"metadata: {{name: {name}}}"
        )
    )
    return pipeline


@pytest.fixture(scope="module")
def reference(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """generate_voice_clone on the demo's Base checkpoint: in context, then the x-vector alone."""
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    np.save(out / "clip.npy", HEARD)
    item = {"text": SAID, "language": "Auto", "ref_audio": str(out / "clip.npy"), "ref_rate": RATE}
    asked = {
        "checkpoint": str(demo_dir / "models" / "tiny-qwen3-tts-base"),
        "voice_clone": [
            {**item, "ref_text": TRANSCRIPT, "x_vector_only": False, "non_streaming": False},
            {**item, "ref_text": None, "x_vector_only": True, "non_streaming": False},
        ],
        "max_new_tokens": CODES + 1,
        "codes": False,  # the waveforms are what is compared here
    }
    return qwen_tts_reference(asked, out), out


def speak_as(base: str, voice: str) -> np.ndarray:
    """The WAV the SDK gets speaking in `voice`, as its int16 samples."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    got = client.audio.speech.create(model="qwen3-tts", input=SAID, voice=voice)  # type: ignore[arg-type]
    samples, _ = soundfile.read(io.BytesIO(got.content), dtype="int16")
    return samples


def speak(base: str, **extra: Any) -> np.ndarray:
    """The WAV the SDK gets, as its int16 samples."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    got = client.audio.speech.create(model="qwen3-tts", input=SAID, voice=None, extra_body=extra)  # type: ignore[arg-type]
    samples, rate = soundfile.read(io.BytesIO(got.content), dtype="int16")
    assert rate == 24000
    return samples


def same_audio(ours: np.ndarray, expected: np.ndarray) -> None:
    same_speech(ours, expected, CODES)


def test_a_voice_cloned_in_context_equals_the_reference(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    """The clip's codes go to code2wav first, as context: what comes out is the new speech alone."""
    _, out = reference
    cloned = speak(base, ref_audio=data_url(CLIP), ref_text=TRANSCRIPT)
    same_audio(cloned, pcm16(waveform(out, "voice_clone_0")))


def test_a_voice_cloned_from_the_x_vector_alone_equals_the_reference(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    _, out = reference
    alone = speak(base, ref_audio=data_url(CLIP), x_vector_only_mode=True, task_type="Base")
    same_audio(alone, pcm16(waveform(out, "voice_clone_1")))
    assert not np.array_equal(alone, pcm16(waveform(out, "voice_clone_0")))


def test_the_speech_socket_clones_as_the_endpoint_does(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    _, out = reference
    config = {"ref_audio": data_url(CLIP), "ref_text": TRANSCRIPT}
    same_audio(spoken_on_socket(base, config, SAID), pcm16(waveform(out, "voice_clone_0")))


def test_the_cloner_sleeps_and_wakes_with_the_talker(base: str) -> None:
    """The speaker and speech encoders are the talker's weights too: moved to host memory and
    back (level 1), dropped and loaded again (level 2); the clone is the same after each. Asleep,
    the talker takes no voice from an upload (a 503 saying so) and nothing is kept."""
    before = speak(base, ref_audio=data_url(CLIP), ref_text=TRANSCRIPT)
    for level in (1, 2):
        r = HTTP.post(f"{base}/v1/omni/sleep", json={"stage_ids": ["talker"], "level": level}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
        r = upload(base, f"asleep{level}")
        assert r.status_code == 503 and "is asleep" in r.json()["error"]["message"], r.text
        assert uploaded(base) == []
        r = HTTP.post(f"{base}/v1/omni/wakeup", json={"stage_ids": ["talker"]}, timeout=120)
        assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
        assert np.array_equal(speak(base, ref_audio=data_url(CLIP), ref_text=TRANSCRIPT), before), level


WAV = data_url(CLIP)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, None, "ref_audio: a Base model speaks in a voice cloned from a clip"),
        ({"ref_audio": WAV}, None, "ref_text: cloning in context needs the clip's transcript"),
        ({"ref_audio": "file:///etc/passwd", "ref_text": "x"}, "ref_audio", "which no client reads"),
        ({"ref_audio": "/etc/passwd", "ref_text": "x"}, "ref_audio", "which no client reads"),
        ({"ref_audio": "http://127.0.0.1:9/a.wav", "ref_text": "x"}, "ref_audio", "does not fetch URLs"),
        ({"ref_audio": "bm90IGF1ZGlv", "ref_text": "x"}, "ref_audio", "not decodable"),
        ({"ref_audio": WAV, "ref_text": "x", "voice": "vivian"}, "voice", "'vivian' is no voice uploaded"),
        ({"ref_audio": WAV, "ref_text": "x", "instructions": "Slowly."}, None, "instructions: a Base model"),
        ({"ref_audio": WAV, "ref_text": "x", "x_vector_only_mode": True}, None, "ref_text: x_vector_only"),
    ],
    ids=[
        "no-clip",
        "no-transcript",
        "file-url",
        "path",
        "http-off",
        "not-audio",
        "voice",
        "instructions",
        "transcript-unused",
    ],
)
def test_what_cloning_cannot_do_is_a_400_naming_it(
    base: str, body: dict[str, Any], param: str | None, says: str
) -> None:
    """The clip's own faults at the gateway, before anything runs; what the model needs at the
    talker (its message names the field)."""
    r = HTTP.post(f"{base}/v1/audio/speech", json={"model": "qwen3-tts", "input": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], r.text


def upload(base: str, name: str, clip: bytes = b"", **fields: str) -> httpx.Response:
    """POST /v1/audio/voices as a form, the clip as a WAV file (CLIP's, unless given)."""
    sample = clip or base64.b64decode(data_url(CLIP).split(",", 1)[1])
    form = {"name": name, "consent": "consent-0042", **fields}
    files = {"audio_sample": ("voice.wav", sample, "audio/wav")}
    return HTTP.post(f"{base}/v1/audio/voices", data=form, files=files, timeout=120)


def uploaded(base: str) -> list[dict[str, Any]]:
    r = HTTP.get(f"{base}/v1/audio/voices", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["voices"] == []  # a Base model has no voices of its own
    return r.json()["uploaded_voices"]


def test_an_uploaded_voice_is_listed_speaks_as_its_clip_and_is_gone_once_deleted(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    """Uploaded with its transcript: cloned in context, the print taken once by the talker
    stage; then from the x-vector alone (no transcript). Each speaks as the reference's clone
    of the same clip; deleted, it is a voice no more."""
    _, out = reference
    r = upload(base, "Narrator", ref_text=TRANSCRIPT, speaker_description="calm")
    assert r.status_code == 200, r.text
    voice = r.json()["voice"]
    assert r.json()["success"] and voice["name"] == "Narrator" and voice["consent"] == "consent-0042"
    assert voice["ref_text"] == TRANSCRIPT and voice["speaker_description"] == "calm"
    assert upload(base, "plain").status_code == 200
    listed = {v["name"]: v for v in uploaded(base)}
    assert set(listed) == {"Narrator", "plain"} and listed["Narrator"]["embedding_dim"] == 64
    assert "ref_text" not in listed["plain"]
    same_audio(speak_as(base, "Narrator"), pcm16(waveform(out, "voice_clone_0")))
    same_audio(speak_as(base, "plain"), pcm16(waveform(out, "voice_clone_1")))
    r = HTTP.post(
        f"{base}/v1/audio/speech",
        json={"model": "qwen3-tts", "input": "x", "voice": "plain", "ref_text": "y"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text", r.text
    for name in ("narrator", "plain"):  # case aside, as names are kept
        assert HTTP.delete(f"{base}/v1/audio/voices/{name}", timeout=30).json()["success"]
    assert uploaded(base) == []
    gone = {"model": "qwen3-tts", "input": "x", "voice": "plain"}
    r = HTTP.post(f"{base}/v1/audio/speech", json=gone, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice", r.text
    assert "'plain' is no voice uploaded to this model" in r.json()["error"]["message"]
    r = HTTP.delete(f"{base}/v1/audio/voices/plain", timeout=30)
    assert r.status_code == 404, r.text


def silence() -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(RATE, dtype=np.float32), RATE, subtype="PCM_16", format="WAV")
    return buf.getvalue()


def short_clip() -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, CLIP[: RATE // 10], RATE, subtype="PCM_16", format="WAV")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "clip", "fields", "status", "param", "says"),
    [
        ("a/b", b"", {}, 400, "name", "name: 1 to 64 letters"),
        ("v1", b"", {"consent": ""}, 400, "consent", "consent: a voice is kept only with"),
        ("v2", b"not audio", {}, 400, "audio_sample", "not decodable"),
        ("v3", silence(), {}, 400, "audio_sample", "the clip is silent"),
        ("v4", short_clip(), {}, 400, "audio_sample", "under the 0.5 s a voice is taken from"),
        ("v5", b"", {"speaker_embedding": "[0.5]"}, 400, "speaker_embedding", "unrecognized field"),
        ("v6", b"", {"ref_text": "x" * 4097}, 400, "ref_text", "more than 4096 characters"),
    ],
    ids=["name", "consent", "not-audio", "silent", "short", "embedding", "long-transcript"],
)
def test_what_an_upload_cannot_be_is_refused_naming_it(
    base: str, name: str, clip: bytes, fields: dict[str, str], status: int, param: str, says: str
) -> None:
    r = upload(base, name, clip, **fields)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], r.text


def test_a_name_taken_is_a_409(base: str) -> None:
    assert upload(base, "twice").status_code == 200
    r = upload(base, "TWICE")
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    assert HTTP.delete(f"{base}/v1/audio/voices/twice", timeout=30).status_code == 200


def test_an_uploaded_voice_outlives_omni_serve(
    demo_dir: Path, tmp_path: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    """Kept in SQLite under the state directory: `omni serve` stopped and started again lists
    the voice and speaks in it, without taking it from the clip again."""
    _, out = reference
    pipeline = base_pipeline(demo_dir, "qwen3-tts-kept")
    with served(pipeline, demo_dir, tmp_path / "first.log") as (_, url):
        assert upload(url, "keeper", ref_text=TRANSCRIPT).status_code == 200
    with served(pipeline, demo_dir, tmp_path / "second.log") as (_, url):
        assert [v["name"] for v in uploaded(url)] == ["keeper"]
        same_audio(speak_as(url, "keeper"), pcm16(waveform(out, "voice_clone_0")))
        assert HTTP.delete(f"{url}/v1/audio/voices/keeper", timeout=30).status_code == 200


def test_distributed_voices_live_in_jetstream(
    demo_dir: Path, tmp_path: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    """Distributed mode: the stages and two gateways as processes of their own on a nats-server
    with JetStream on. A voice uploaded through one gateway is listed by the other and speaks
    there as the reference's clone; deleted there, the first lists it no more."""
    _, out = reference
    spec = yaml.safe_load(base_pipeline(demo_dir, "qwen3-tts-spread").read_text())
    spec["spec"].update(mode="Distributed", nats={"url": ""}, connectors={"default": {"kind": "inline"}})
    spec["spec"]["gateway"]["voices"] = {"stateDir": str(tmp_path / "state")}
    pipeline = tmp_path / "qwen3-tts-spread.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    server = EmbeddedNats(args=("-js", "-sd", str(tmp_path / "jetstream")))
    try:
        with deployed(pipeline, {"talker": 1, "code2wav": 1}, 2, server.url, demo_dir, tmp_path) as d:
            one, two = (g[1] for g in d.gateways)
            assert upload(one, "shared", ref_text=TRANSCRIPT).status_code == 200
            assert [v["name"] for v in uploaded(two)] == ["shared"]
            same_audio(speak_as(two, "shared"), pcm16(waveform(out, "voice_clone_0")))
            assert HTTP.delete(f"{two}/v1/audio/voices/shared", timeout=30).status_code == 200
            assert uploaded(one) == []
        assert not (tmp_path / "state").exists()  # nothing in SQLite
    finally:
        server.stop()
