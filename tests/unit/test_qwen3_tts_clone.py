"""Qwen3-TTS's Base model clones a voice as the reference does, the `qwen-tts` package's own code
(tests/qwen_tts_reference.py), on the tiny Base checkpoint: what it takes from a clip (the
speaker encoder's x-vector; the speech tokenizer's codes, a clip at 16 kHz resampled first),
then the codes and waveforms of `generate_voice_clone`, from the x-vector alone and in context
(both prompt layouts), through the stage engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import EngineCall, InvalidRequest
from omni_stage.models.qwen3_tts.checkpoint import write_checkpoint
from omni_stage.models.qwen3_tts.loading import load_cloner
from omni_stage.payload import concat
from tests.helpers import ROOT, example_stage
from tests.qwen_tts_reference import qwen_tts_reference, waveform

BUDGET = 10
EXAMPLE = ROOT / "examples" / "qwen3-tts.yaml"
TRANSCRIPT = "This is my voice."


def clip(rate: int, seconds: float, seed: int) -> np.ndarray:
    """A voice-like clip: a gliding tone and its harmonics, with a little noise."""
    t = np.arange(int(rate * seconds)) / rate
    rng = np.random.default_rng(seed)
    pitch = 2 * np.pi * (140 + 60 * t) * t
    wav = 0.3 * np.sin(pitch) + 0.1 * np.sin(2 * pitch) + 0.02 * rng.standard_normal(t.shape)
    return wav.astype(np.float32)


CLIPS = {"24k": (clip(24000, 1.2, 0), 24000), "16k": (clip(16000, 0.9, 1), 16000)}
ITEMS = [
    {
        "clip": "24k",
        "text": "Hello there.",
        "language": "English",
        "x_vector_only": True,
        "non_streaming": False,
    },
    {
        "clip": "16k",
        "text": "Hello there.",
        "language": "Auto",
        "x_vector_only": True,
        "non_streaming": False,
    },
    {
        "clip": "24k",
        "text": "Hello there.",
        "language": "English",
        "x_vector_only": False,
        "non_streaming": False,
    },
    {
        "clip": "16k",
        "text": "Good morning to you all.",
        "language": "Auto",
        "x_vector_only": False,
        "non_streaming": False,
    },
    {
        "clip": "24k",
        "text": "Hello there.",
        "language": "English",
        "x_vector_only": False,
        "non_streaming": True,
    },
]


@pytest.fixture(scope="module")
def cloned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """A tiny Base checkpoint, and the reference's cloning on it."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp("qwen3-tts") / "tiny-qwen3-tts-base", "base", seed=2)
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    for name, (wav, _) in CLIPS.items():
        np.save(out / f"clip_{name}.npy", wav)
    asked = {
        "checkpoint": str(ckpt),
        "voice_clone": [
            {
                "text": item["text"],
                "language": item["language"],
                "ref_audio": str(out / f"clip_{item['clip']}.npy"),
                "ref_rate": CLIPS[item["clip"]][1],
                "ref_text": None if item["x_vector_only"] else TRANSCRIPT,
                "x_vector_only": item["x_vector_only"],
                "non_streaming": item["non_streaming"],
            }
            for item in ITEMS
        ],
        "max_new_tokens": BUDGET,
    }
    return ckpt, qwen_tts_reference(asked, out), out


def test_the_reference_reads_every_tensor_of_the_base_checkpoint(
    cloned: tuple[Path, dict[str, Any], Path],
) -> None:
    _, result, _ = cloned
    assert result["model"] == {"unexpected": [], "missing": []}
    assert result["speech_tokenizer"] == {"unexpected": [], "missing": []}


@torch.inference_mode()
def test_what_a_clip_gives_equals_the_reference(cloned: tuple[Path, dict[str, Any], Path]) -> None:
    """The x-vector (the speaker encoder on the clip's mel spectrogram) and, in context, the
    clip's codes (the speech tokenizer's encode), a 16 kHz clip resampled as librosa does."""
    ckpt, result, out = cloned
    cloner = load_cloner(ckpt, torch.device("cpu"), torch.float32)
    for i, item in enumerate(ITEMS):
        wav, rate = CLIPS[item["clip"]]
        voice = cloner.clone(torch.from_numpy(wav), rate, not item["x_vector_only"])
        expected = waveform(out, f"voice_clone_{i}_xvector")
        np.testing.assert_allclose(voice.x_vector.numpy(), expected, atol=1e-5, rtol=1e-5)
        ref_codes = result["voice_clone"][i]["ref_codes"]
        assert (voice.codes is None) == (ref_codes is None)
        if voice.codes is not None:
            assert voice.codes.tolist() == ref_codes
            assert len(ref_codes) == -(-len(wav) * 24000 // rate // 1920)
    xvectors = {
        CLIPS[item["clip"]][1]: waveform(out, f"voice_clone_{i}_xvector") for i, item in enumerate(ITEMS)
    }
    assert not np.allclose(xvectors[24000], xvectors[16000])  # each clip a voice of its own


async def through_the_stages(
    ckpt: Path, request: dict[str, Any], sampling: Sampling
) -> tuple[Any, np.ndarray]:
    """The example's two stages on `ckpt`, in this process: the talker's codes, code2wav's audio."""
    talker, code2wav = example_stage(EXAMPLE, "talker", ckpt), example_stage(EXAMPLE, "code2wav", ckpt)
    for e in (talker, code2wav):
        await e.start()
    try:
        frames = [
            o.data async for o in talker.generate(EngineCall("r", {"request": request}, True, sampling))
        ]
        call = EngineCall("r", {"talker": concat(frames)}, True, Sampling())
        audio = [o.data["audio"] async for o in code2wav.generate(call)]
    finally:
        for e in (talker, code2wav):
            await e.close()
    return concat(frames), torch.cat(audio).numpy()


def clone_request(item: dict[str, Any]) -> tuple[dict[str, Any], Sampling]:
    wav, rate = CLIPS[item["clip"]]
    request = {
        "prompt": item["text"],
        "ref_audio": {"media": "m0", "sample_rate": rate},
        "media": {"m0": torch.from_numpy(wav)},
    }
    sampling = Sampling(
        max_tokens=BUDGET,
        language=item["language"],
        ref_text=None if item["x_vector_only"] else TRANSCRIPT,
        x_vector_only_mode=item["x_vector_only"],
        non_streaming_mode=item["non_streaming"],
    )
    return request, sampling


def test_a_cloned_voice_equals_the_reference(cloned: tuple[Path, dict[str, Any], Path]) -> None:
    """Every item through the stage engines: the talker's codes (a voice cloned in context sends
    the clip's codes first, as context, never voiced), code2wav's audio."""
    ckpt, result, out = cloned
    spoken = []
    for i, item in enumerate(ITEMS):
        request, sampling = clone_request(item)
        codes, audio = asyncio.run(through_the_stages(ckpt, request, sampling))
        expected = result["voice_clone"][i]
        context = expected["ref_codes"] or []
        assert codes.get("context", 0) == len(context), item
        assert codes["codes"][: len(context)].tolist() == context
        assert codes["codes"][len(context) :].tolist() == expected["codes"], item
        np.testing.assert_allclose(audio, waveform(out, f"voice_clone_{i}"), atol=1e-6, rtol=0)
        spoken.append(expected["codes"])
    # Not vacuous: each clip, mode and layout speaks codes of its own.
    assert len({json.dumps(c) for c in spoken}) == len(ITEMS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ref_audio": None}, "ref_audio: a Base model speaks in a voice cloned from a clip: send one"),
        (
            {"ref_text": None, "x_vector_only_mode": False},
            "ref_text: cloning in context needs the clip's transcript",
        ),
        ({"instructions": "Speak slowly."}, "instructions: a Base model"),
    ],
)
def test_a_base_model_refuses_what_it_cannot_clone_from(
    cloned: tuple[Path, dict[str, Any], Path], change: dict[str, Any], message: str
) -> None:
    ckpt, _, _ = cloned
    request, sampling = clone_request(ITEMS[2])
    if "ref_audio" in change:
        request.pop("ref_audio")
    fields = {k: v for k, v in change.items() if k != "ref_audio"}
    sampling = Sampling(**(sampling.asked() | fields))
    with pytest.raises(InvalidRequest, match=message):
        asyncio.run(through_the_stages(ckpt, request, sampling))
