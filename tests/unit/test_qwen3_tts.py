"""Qwen3-TTS's talker and speech decoder equal the reference, the `qwen-tts` package's own code
(scripts/qwen_tts_reference.py, in its own virtualenv: it pins transformers 4.57), on the tiny
CustomVoice checkpoint: the reference reads every tensor of it and no other, draws the same codes
greedily (a named speaker, a dialect speaker, a style instruction, both prompt layouts) and its
`generate_custom_voice` and tokenizer `decode` give the same waveforms."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from omni_stage.models.qwen3_tts.checkpoint import write_checkpoint
from omni_stage.models.qwen3_tts.prompt import TTSIds, tts_prompt
from omni_stage.models.qwen3_tts.speech import TTSTalker, load_decoder, load_talker, read_config

ROOT = Path(__file__).resolve().parents[2]
QWEN_TTS_PYTHON = ROOT / ".venv-qwen-tts" / "bin" / "python"
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
    if not QWEN_TTS_PYTHON.exists():
        pytest.skip(f"{QWEN_TTS_PYTHON} is missing: `make qwen-tts-venv` (or `make test`) builds it")
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    request = out / "request.json"
    request.write_text(
        json.dumps(
            {"checkpoint": str(checkpoint), "custom_voice": ITEMS, "decode": DECODE, "max_new_tokens": BUDGET}
        )
    )
    run = subprocess.run(
        [str(QWEN_TTS_PYTHON), str(ROOT / "scripts" / "qwen_tts_reference.py"), str(request), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


def ours(checkpoint: Path) -> tuple[TTSTalker, Any, Any]:
    from transformers import AutoTokenizer

    talker = load_talker(checkpoint, torch.device("cpu"), torch.float32)
    ids = TTSIds.of(read_config(checkpoint))
    frames = StaticFrames(talker, 16, 1, capture=False)
    return TTSTalker(talker, ids, frames), AutoTokenizer.from_pretrained(checkpoint), ids


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
        np.testing.assert_allclose(wav.numpy(), np.load(out / f"custom_voice_{i}.npy"), atol=1e-6, rtol=0)
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
    expected = np.load(out / "decode_0.npy")
    assert wav.shape[0] == len(DECODE[0]) * 1920 == expected.shape[0]
    np.testing.assert_allclose(wav.numpy(), expected, atol=1e-6, rtol=0)
    assert float(np.abs(expected).max()) > 1e-3  # a waveform, not silence


def test_an_unknown_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Qwen3-TTS variant 'klingon'"):
        write_checkpoint(tmp_path, "klingon")
