"""Qwen3-TTS's talker and speech decoder equal the reference, the `qwen-tts` package's own code
(tests/qwen_tts_reference.py), on the tiny
CustomVoice checkpoint: the reference reads every tensor of it and no other, draws the same codes
greedily (a named speaker, a dialect speaker, a style instruction, both prompt layouts) and its
`generate_custom_voice` and tokenizer `decode` give the same waveforms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from omni_stage.models.qwen3_tts.checkpoint import write_checkpoint
from omni_stage.models.qwen3_tts.loading import load_decoder, load_talker, read_config
from omni_stage.models.qwen3_tts.prompt import TTSIds, tts_prompt
from omni_stage.models.qwen3_tts.steps import TTSSteps
from tests.qwen_tts_reference import qwen_tts_reference, waveform

BUDGET = 24
ITEMS = [  # both of the reference's prompt layouts (non-streaming: its default here)
    {"text": "Hello there, how are you?", "speaker": "Vivian", "language": "English", "non_streaming": True},
    {"text": "ni hao", "speaker": "dylan", "language": "Chinese", "non_streaming": False},
    {"text": "A calm voice.", "speaker": "ryan", "language": "Auto", "non_streaming": True},
    {"text": "A calm voice.", "speaker": "ryan", "language": "Auto", "non_streaming": False},
]
ITEMS = [{**item, "instruct": ""} for item in ITEMS] + [
    {
        "text": "A calm voice.",
        "speaker": "ryan",
        "language": "Auto",
        "non_streaming": n,
        "instruct": "Speak slowly.",
    }
    for n in (True, False)
]
DECODE = [[[(7 * f + g) % 2048 for g in range(16)] for f in range(5)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-tts") / "tiny-qwen3-tts-custom-voice")


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    asked = {"checkpoint": str(checkpoint), "custom_voice": ITEMS, "decode": DECODE, "max_new_tokens": BUDGET}
    return qwen_tts_reference(asked, out), out


def ours(checkpoint: Path) -> tuple[TTSSteps, Any, Any]:
    from transformers import AutoTokenizer

    talker = load_talker(checkpoint, torch.device("cpu"), torch.float32)
    ids = TTSIds.of(read_config(checkpoint))
    frames = StaticFrames(talker, 16, 1, capture=False)
    return TTSSteps(talker, ids, frames), AutoTokenizer.from_pretrained(checkpoint), ids


def turn(tok: Any, text: str, role: str = "assistant", reply: bool = True) -> torch.Tensor:
    tail = "<|im_start|>assistant\n" if reply else ""
    return tok(f"<|im_start|>{role}\n{text}<|im_end|>\n{tail}", return_tensors="pt").input_ids


def test_the_reference_reads_every_tensor_of_the_checkpoint(reference: tuple[dict[str, Any], Path]) -> None:
    result, _ = reference
    assert result["model"] == {"unexpected": [], "missing": []}
    assert result["speech_tokenizer"] == {"unexpected": [], "missing": []}


@torch.inference_mode()
def test_custom_voice_codes_and_audio_equal_the_reference(
    checkpoint: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    result, out = reference
    speaker, tok, ids = ours(checkpoint)
    decoder = load_decoder(checkpoint, torch.device("cpu"))
    spoken = []
    for i, item in enumerate(ITEMS):
        instruct = turn(tok, item["instruct"], "user", reply=False) if item["instruct"] else None
        prompt = tts_prompt(
            speaker.talker,
            ids,
            turn(tok, item["text"]),
            item["language"],
            item["speaker"],
            instruct,
            item["non_streaming"],
        )
        codes = speaker.speak(prompt, BUDGET)
        assert codes == result["custom_voice"][i], item
        wav = decoder(torch.tensor(codes).T[None])[0, 0]
        np.testing.assert_allclose(wav.numpy(), waveform(out, f"custom_voice_{i}"), atol=1e-6, rtol=0)
        spoken.append(codes)
    # Not vacuous: each voice, text, layout and instruction speaks codes of its own.
    assert len({json.dumps(c) for c in spoken}) == len(ITEMS)


@torch.inference_mode()
def test_the_decoder_equals_the_tokenizers_decode(
    checkpoint: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    _, out = reference
    decoder = load_decoder(checkpoint, torch.device("cpu"))
    wav = decoder(torch.tensor(DECODE[0]).T[None])[0, 0]
    expected = waveform(out, "decode_0")
    assert wav.shape[0] == len(DECODE[0]) * 1920 == expected.shape[0]
    np.testing.assert_allclose(wav.numpy(), expected, atol=1e-6, rtol=0)
    assert float(np.abs(expected).max()) > 1e-3  # a waveform, not silence


def test_an_unknown_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Qwen3-TTS variant 'klingon'"):
        write_checkpoint(tmp_path, "klingon")
