"""Reading a Qwen3-TTS checkpoint directory as the real one is laid out: config.json, the
`talker.` tensors of model.safetensors, and speech_tokenizer/'s `decoder.` for the stage that
decodes; a Base model's talker stage also loads what clones a voice (`speaker_encoder.`, and the
speech tokenizer's `encoder.`). Strict: a tensor missing or left over is an error naming it.
With `dummy` (`loadFormat: dummy`) each is built on its device at the config's sizes with
random weights instead, and no weight is read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from omni_stage.models.qwen3_tts.cloning import SpeakerEncoder, SpeechEncoder, VoiceCloner
from omni_stage.models.qwen3_tts.modeling import SpeechDecoder, Talker
from omni_stage.models.qwen_omni.parts import dummy_weights

M = TypeVar("M", bound=nn.Module)


def read_config(path: Path) -> dict[str, Any]:
    """config.json; ValueError where it is not a Qwen3-TTS checkpoint's."""
    try:
        settings: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} has no readable config.json: {exc}") from None
    if settings.get("model_type") != "qwen3_tts":
        raise ValueError(f"{path} is not a Qwen3-TTS checkpoint (model_type {settings.get('model_type')!r})")
    return settings


def _tensors(file: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k.removeprefix(prefix): v for k, v in load_file(file).items() if k.startswith(prefix)}


def _loaded(
    build: Callable[[], M], file: Path, prefix: str, device: torch.device, dtype: torch.dtype, dummy: bool
) -> M:
    """`build()`'s module with `file`'s tensors under `prefix`, on `device` in `dtype`; or built
    there with dummy weights (`dummy`)."""
    if dummy:
        with torch.device(device):
            module = build()
        return dummy_weights(module.to(dtype), device)  # type: ignore[no-any-return]
    module = build()
    module.load_state_dict(_tensors(file, prefix), strict=True)
    return module.to(device, dtype).eval()


def load_talker(path: Path, device: torch.device, dtype: torch.dtype, dummy: bool = False) -> Talker:
    section = read_config(path)["talker_config"]
    return _loaded(lambda: Talker(section), path / "model.safetensors", "talker.", device, dtype, dummy)


def load_decoder(path: Path, device: torch.device, dummy: bool = False) -> SpeechDecoder:
    """The speech tokenizer's decoder, in float32 (as the reference decodes)."""
    section = _tokenizer_config(path)["decoder_config"]
    weights = _tokenizer_weights(path)
    return _loaded(lambda: SpeechDecoder(section), weights, "decoder.", device, torch.float32, dummy)


def load_cloner(path: Path, device: torch.device, dtype: torch.dtype, dummy: bool = False) -> VoiceCloner:
    """A Base model's speaker encoder (in the talker's dtype, as the reference runs it) and the
    speech tokenizer's encoder (float32, as the tokenizer encodes)."""
    from transformers import MimiConfig

    section = read_config(path).get("speaker_encoder_config") or {}
    speaker = _loaded(
        lambda: SpeakerEncoder(section), path / "model.safetensors", "speaker_encoder.", device, dtype, dummy
    )
    settings = _tokenizer_config(path)
    mimi = MimiConfig(**{k: v for k, v in settings["encoder_config"].items() if k != "model_type"})
    weights = _tokenizer_weights(path)
    speech = _loaded(lambda: SpeechEncoder(mimi), weights, "encoder.", device, torch.float32, dummy)
    groups = int(settings.get("encoder_valid_num_quantizers", 16))
    frame = int(settings.get("encode_downsample_rate", 1920))
    return VoiceCloner(speaker, speech, groups, frame)


def _tokenizer_weights(path: Path) -> Path:
    return path / "speech_tokenizer" / "model.safetensors"


def _tokenizer_config(path: Path) -> dict[str, Any]:
    settings: dict[str, Any] = json.loads((path / "speech_tokenizer" / "config.json").read_text())
    return settings
