"""Qwen2.5-Omni served end to end: `omni serve examples/qwen2.5-omni.yaml` (thinker -> talker
-> code2wav from one tiny checkpoint), the official openai client, and the reference computed
here: transformers' `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`,
same checkpoint, same prompt, greedy, the DiT's noise from the same seed."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.e2e.test_serve import audio_delta
from tests.helpers import decode_wav, served_example
from tests.qwen_reference import reference_generate

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
THINKER_TOKENS, TALKER_CODES, SEED = 10, 48, 11  # TALKER_CODES: the example's talker max_tokens


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_example("qwen2.5-omni.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as url:
        yield url


@pytest.fixture(scope="module")
def reference(demo_dir: Path) -> dict[str, Any]:
    path = demo_dir / "models" / "tiny-qwen2.5-omni"
    ref = reference_generate(path, MESSAGES, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    return {"text": ref["text"], "audio": ref["audio"].numpy()}


def pcm16(samples: np.ndarray) -> np.ndarray:
    """What the gateway's 16-bit PCM carries of a float waveform, read back as soundfile reads it."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16) / 32768.0


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(base: str, **extra: Any) -> Any:
    return client(base).chat.completions.create(
        model="qwen2.5-omni",
        messages=MESSAGES,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        seed=SEED,
        **{"max_tokens": THINKER_TOKENS, **extra},
    )


def test_text_and_speech_equal_the_reference(base: str, reference: dict[str, Any]) -> None:
    """Text exactly; the waveform, decoded in chunks as it streams, to within one step of
    16-bit PCM (in float32 it is within 1e-5 of the reference's, tests/unit/test_qwen_omni.py)."""
    r = ask(base, audio={"voice": "Ethan", "format": "wav"})
    assert r.choices[0].message.content == reference["text"]
    samples, rate = decode_wav(r.choices[0].message.audio.data)
    assert rate == 24000
    expected = pcm16(reference["audio"])
    assert samples.shape == expected.shape
    assert np.abs(samples - expected).max() <= 1 / 32768


def test_streamed_text_and_speech_equal_the_reference(base: str, reference: dict[str, Any]) -> None:
    text, pcm = "", b""
    for chunk in ask(base, audio={"voice": "Ethan", "format": "pcm16"}, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if (a := audio_delta(chunk)) is not None and a.get("data"):
            pcm += base64.b64decode(str(a["data"]))
    assert text == reference["text"]
    samples = np.frombuffer(pcm, dtype="<i2") / 32768.0
    expected = pcm16(reference["audio"])
    assert samples.shape == expected.shape
    assert np.abs(samples - expected).max() <= 1 / 32768


def test_an_unknown_voice_is_a_400_that_lists_the_voices(base: str) -> None:
    with pytest.raises(
        openai.BadRequestError, match="voice 'alloy' is not one of this model's voices: Chelsie, Ethan"
    ):
        ask(base, audio={"voice": "alloy", "format": "wav"})


def test_audio_starts_before_the_text_ends(base: str) -> None:
    """The first audio chunk needs 24 codes (12, and 12 of right context), so 25 thinker
    tokens, and one chunk's decode; the thinker writes 1000. Measured on 2 cores: the first
    audio came about 220 tokens in. Order of events in the stream, not timing."""
    events = []
    for chunk in ask(base, audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, max_tokens=1000):
        if chunk.choices and chunk.choices[0].delta.content:
            events.append("text")
        if (a := audio_delta(chunk)) is not None and a.get("data"):
            events.append("audio")
    assert events.count("audio") > 1
    last_text = len(events) - 1 - events[::-1].index("text")
    assert events.index("audio") < last_text, events


def test_a_one_token_answer_is_text_and_no_speech(base: str) -> None:
    """The talker starts on the second token's reply state: a one-token answer has nothing to
    speak. transformers' own generate fails on it; the server answers text and empty audio."""
    r = ask(base, audio={"voice": "Ethan", "format": "wav"}, max_tokens=1)
    assert len(r.choices[0].message.content) == 1
    samples, _ = decode_wav(r.choices[0].message.audio.data)
    assert len(samples) == 0
