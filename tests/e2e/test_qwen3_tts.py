"""Qwen3-TTS served end to end: `omni serve examples/qwen3-tts.yaml` (talker -> code2wav from one
checkpoint) on the tiny CustomVoice checkpoint, the official openai client's `audio.speech.create`, and the
reference: the `qwen-tts` package's own `generate_custom_voice`, greedy, same checkpoint and
inputs (tests/qwen_tts_reference.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile

from tests.deployment import gauges, settle
from tests.helpers import HTTP, ROOT, replica_metric, served
from tests.qwen_tts_reference import pcm16, qwen_tts_reference, same_speech, spoken_on_socket, waveform

pytestmark = pytest.mark.slow

CODES = 12
"""The talker's budget here (frames: 0.96 s of audio); the example's is 64."""
SAID = "Hello there, how are you?"
TALKER_ARGS = "args: {part: talker, threads: 1}"
SLOT_STEPS = "omni_engine_slot_steps_total"


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen3-tts.yaml on the CustomVoice checkpoint (its one-line change), with a short
    budget, the talker's decode steps at fixed shapes (`fixedSteps`: what `cudaGraphs` replays
    on CUDA; the speech the reference's either way)."""
    example = (ROOT / "examples" / "qwen3-tts.yaml").read_text()
    assert "sampling: {max_tokens: 64}" in example and example.count("./models/tiny-qwen3-tts-base\n") == 2
    assert TALKER_ARGS in example
    pipeline = demo_dir / "qwen3-tts-short.yaml"
    pipeline.write_text(
        example.replace("sampling: {max_tokens: 64}", f"sampling: {{max_tokens: {CODES + 1}}}")
        .replace("./models/tiny-qwen3-tts-base\n", "./models/tiny-qwen3-tts\n")
        .replace(TALKER_ARGS, TALKER_ARGS[:-1] + ", fixedSteps: true}")
    )
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def reference(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """generate_custom_voice on the demo checkpoint: three voices, with and without a style."""
    items = [
        {"text": SAID, "speaker": v, "language": "Auto", "instruct": i, "non_streaming": True}
        for v, i in [("vivian", ""), ("ryan", ""), ("aiden", ""), ("vivian", "Speak slowly.")]
    ] + [{"text": SAID, "speaker": "vivian", "language": "Auto", "instruct": "", "non_streaming": False}]
    asked = {
        "checkpoint": str(demo_dir / "models" / "tiny-qwen3-tts"),
        "custom_voice": items,
        "max_new_tokens": CODES + 1,
        "codes": False,  # the waveforms are what is compared here
    }
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    return qwen_tts_reference(asked, out), out


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def speak(base: str, voice: str, **extra: Any) -> np.ndarray:
    """The WAV the SDK gets, as its int16 samples."""
    got = client(base).audio.speech.create(model="qwen3-tts", input=SAID, voice=voice, **extra)  # type: ignore[arg-type]
    samples, rate = soundfile.read(io.BytesIO(got.content), dtype="int16")
    assert rate == 24000
    return samples


def same_audio(ours: np.ndarray, expected: np.ndarray) -> None:
    same_speech(ours, expected, CODES)


def test_the_voices_are_the_checkpoints_speakers(base: str) -> None:
    r = HTTP.get(f"{base}/v1/audio/voices", timeout=30)
    assert r.status_code == 200
    assert r.json() == {"voices": ["aiden", "dylan", "ryan", "serena", "vivian"], "uploaded_voices": []}


def test_speech_equals_the_reference(base: str, reference: tuple[dict[str, Any], Path]) -> None:
    _, out = reference
    same_audio(speak(base, "vivian"), pcm16(waveform(out, "custom_voice_0")))


def test_a_style_instruction_is_followed(base: str, reference: tuple[dict[str, Any], Path]) -> None:
    _, out = reference
    styled = speak(base, "vivian", instructions="Speak slowly.")
    same_audio(styled, pcm16(waveform(out, "custom_voice_3")))
    assert not np.array_equal(styled, pcm16(waveform(out, "custom_voice_0")))


def test_vllm_omnis_budget_and_prompt_layout_are_honoured(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    """`max_new_tokens`: the talker's codes 0 at most (the last one makes no frame); and
    `non_streaming_mode: false`, the text a token a frame, equal to the reference's."""
    _, out = reference
    short = speak(base, "vivian", extra_body={"max_new_tokens": 5})
    assert short.shape == (4 * 1920,)
    streamed = speak(base, "vivian", extra_body={"non_streaming_mode": False})
    same_audio(streamed, pcm16(waveform(out, "custom_voice_4")))
    assert not np.array_equal(streamed, pcm16(waveform(out, "custom_voice_0")))


def test_requests_spoken_together_equal_each_alone(base: str, reference: tuple[dict[str, Any], Path]) -> None:
    """Three voices at once: the talker batches their frames and steps (maxInflight 8), every
    step at a bucket's fixed shapes, as its metric says (none on the table's own shapes)."""
    _, out = reference
    steps = {how: replica_metric(base, "talker", SLOT_STEPS, ran=how) for how in ("fixed", "own")}
    with ThreadPoolExecutor(3) as pool:
        spoken = list(pool.map(lambda v: speak(base, v), ["vivian", "ryan", "aiden"]))
    for i, samples in enumerate(spoken):
        same_audio(samples, pcm16(waveform(out, f"custom_voice_{i}")))
    assert replica_metric(base, "talker", SLOT_STEPS, ran="fixed") - steps["fixed"] >= CODES - 1
    assert replica_metric(base, "talker", SLOT_STEPS, ran="own") == steps["own"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"language": "Klingon"},
            "language",
            "language: 'Klingon' is not one of this model's languages: Auto, Chinese, English, French",
        ),
        ({"task_type": "VoiceDesign"}, None, "task_type: this model does CustomVoice, not VoiceDesign"),
        ({"voice": "nobody"}, "voice", "voice 'nobody' is not one of this model's voices: aiden, dylan"),
        ({"speed": 1.5}, None, "speed: Qwen3-TTS speaks at the pace it draws its codes"),
        ({"stream_format": "sse", "top_k": 3}, "top_k", "top_k: unrecognized request argument"),
        ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio", "clones no voice (Base models do)"),
        ({"ref_text": "Hi."}, None, "ref_text: this model does CustomVoice; a Base model clones voices"),
    ],
    ids=["language", "task-type", "voice", "speed", "unknown-field", "ref-audio", "ref-text"],
)
def test_what_the_model_cannot_do_is_a_400_naming_it(
    base: str, body: dict[str, Any], param: str | None, says: str
) -> None:
    """The language and the voice before anything runs (the talker announces them); the task at
    the talker."""
    request = {"model": "qwen3-tts", "input": "x", "voice": "vivian", **body}
    r = HTTP.post(f"{base}/v1/audio/speech", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], r.text


def test_a_model_that_clones_no_voice_takes_no_upload(base: str) -> None:
    """CustomVoice: its speakers' names are taken (409); any other upload is a 400 that says
    this model clones no voice, and nothing is kept."""
    buf = io.BytesIO()
    soundfile.write(buf, 0.3 * np.sin(np.arange(24000) / 5.0), 24000, subtype="PCM_16", format="WAV")
    files = {"audio_sample": ("v.wav", buf.getvalue(), "audio/wav")}
    for name, status, says in [
        ("Vivian", 409, "a voice named 'Vivian' exists"),
        ("mine", 400, "clones no voice (Base models do)"),
    ]:
        form = {"name": name, "consent": "c-1"}
        r = HTTP.post(f"{base}/v1/audio/voices", data=form, files=files, timeout=60)
        assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert HTTP.get(f"{base}/v1/audio/voices", timeout=30).json()["uploaded_voices"] == []


def test_a_client_that_walks_away_mid_speech_leaves_nothing_held(base: str) -> None:
    """A client that walks away once its first audio has come (the first code's, sent at once;
    the rest comes when the talker is done): the request is dropped wherever it is, the
    talker's queued step with it; every process goes back to what it held before, and the next
    one is served."""
    speak(base, "ryan")  # (a first request opens NATS's reply inbox, which stays)
    idle = gauges([base])
    body = {"model": "qwen3-tts", "input": SAID, "voice": "ryan", "stream_format": "sse"}
    with HTTP.stream("POST", f"{base}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line)
        assert first.startswith("data: ") and "speech.audio.delta" in first, first
    # (closed here: mid-speech, the talker twelve frames from done)
    settle([base], idle)
    assert speak(base, "ryan").shape == (CODES * 1920,)


def test_the_speech_socket_speaks_with_a_style_as_the_reference(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    """vLLM-Omni's text-in speech-out socket: its session.config's instructions and language go
    to the talker as a speech request's do."""
    _, out = reference
    config = {"voice": "vivian", "instructions": "Speak slowly.", "language": "Auto"}
    same_audio(spoken_on_socket(base, config, SAID), pcm16(waveform(out, "custom_voice_3")))


def test_a_batch_speaks_each_item_in_order_and_an_items_failure_is_its_own(
    base: str, reference: tuple[dict[str, Any], Path]
) -> None:
    """vLLM-Omni's batch endpoint: the batch's fields are the items' defaults, an item's own win;
    the three voices equal the reference's, in order, and the item naming a voice the model
    lacks fails alone."""
    _, out = reference
    items = [{"input": SAID}, {"input": SAID, "voice": "ryan"}, {"input": SAID, "voice": "nobody"}]
    items.append({"input": SAID, "voice": "aiden"})
    body = {"model": "qwen3-tts", "voice": "vivian", "response_format": "pcm", "items": items}
    r = HTTP.post(f"{base}/v1/audio/speech/batch", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["total"], got["succeeded"], got["failed"]) == (4, 3, 1)
    assert [x["index"] for x in got["results"]] == [0, 1, 2, 3]
    assert got["results"][2]["status"] == "error"
    assert "voice 'nobody' is not one of this model's voices" in got["results"][2]["error"]
    for result, expected in zip([got["results"][i] for i in (0, 1, 3)], (0, 1, 2), strict=True):
        assert result["status"] == "success" and result["media_type"] == "audio/pcm"
        assert result["usage"]["output_tokens"] == CODES
        samples = np.frombuffer(base64.b64decode(result["audio_data"]), dtype="<i2")
        same_audio(samples, pcm16(waveform(out, f"custom_voice_{expected}")))


def test_a_batch_is_refused_whole_only_for_what_is_wrong_with_it_whole(base: str) -> None:
    for body, param in [
        ({"items": []}, "items"),
        ({"items": [{"input": "x"}] * 33}, "items"),
        ({"items": [{"input": "x", "speaker_embedding": [0.5]}]}, "items.0.speaker_embedding"),
        ({"model": "other", "items": [{"input": "x"}]}, "model"),
    ]:
        r = HTTP.post(f"{base}/v1/audio/speech/batch", json=body, timeout=60)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"] == param, r.text


def test_the_talker_sleeps_at_each_level_and_wakes_to_the_same_voice(base: str) -> None:
    """Level 1 moves its weights to host memory and back, level 2 drops them and loads them
    again: each time its code predictor's frames are built anew on them, and it speaks exactly
    as before."""
    before = speak(base, "serena")
    for level in (1, 2):
        r = HTTP.post(f"{base}/v1/omni/sleep", json={"stage_ids": ["talker"], "level": level}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
        with pytest.raises(openai.APIStatusError) as asleep:
            speak(base, "serena")
        assert asleep.value.status_code == 503
        r = HTTP.post(f"{base}/v1/omni/wakeup", json={"stage_ids": ["talker"]}, timeout=120)
        assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
        assert np.array_equal(speak(base, "serena"), before), level
