"""Reading a Qwen3-TTS checkpoint directory as the real one is laid out: config.json, the
`talker.` tensors of model.safetensors, and speech_tokenizer/'s `decoder.` for the stage that
decodes; a Base model's talker stage also loads what clones a voice (`speaker_encoder.`, and the
speech tokenizer's `encoder.`). Strict: a tensor missing or left over is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omni_stage.models.qwen3_tts.cloning import SpeakerEncoder, SpeechEncoder, VoiceCloner
from omni_stage.models.qwen3_tts.modeling import SpeechDecoder, Talker


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


def load_talker(path: Path, device: torch.device, dtype: torch.dtype) -> Talker:
    talker = Talker(read_config(path)["talker_config"])
    talker.load_state_dict(_tensors(path / "model.safetensors", "talker."), strict=True)
    return talker.to(device, dtype).eval()


def load_decoder(path: Path, device: torch.device) -> SpeechDecoder:
    """The speech tokenizer's decoder, in float32 (as the reference decodes)."""
    decoder = SpeechDecoder(_tokenizer_config(path)["decoder_config"])
    decoder.load_state_dict(_tensors(_tokenizer_weights(path), "decoder."), strict=True)
    return decoder.to(device, torch.float32).eval()


def load_cloner(path: Path, device: torch.device, dtype: torch.dtype) -> VoiceCloner:
    """A Base model's speaker encoder (in the talker's dtype, as the reference runs it) and the
    speech tokenizer's encoder (float32, as the tokenizer encodes)."""
    from transformers import MimiConfig

    speaker = SpeakerEncoder(read_config(path).get("speaker_encoder_config") or {})
    speaker.load_state_dict(_tensors(path / "model.safetensors", "speaker_encoder."), strict=True)
    settings = _tokenizer_config(path)
    mimi = {k: v for k, v in settings["encoder_config"].items() if k != "model_type"}
    speech = SpeechEncoder(MimiConfig(**mimi))
    speech.load_state_dict(_tensors(_tokenizer_weights(path), "encoder."), strict=True)
    groups = int(settings.get("encoder_valid_num_quantizers", 16))
    frame = int(settings.get("encode_downsample_rate", 1920))
    speaker, speech = speaker.to(device, dtype).eval(), speech.to(device, torch.float32).eval()
    return VoiceCloner(speaker, speech, groups, frame)


def _tokenizer_weights(path: Path) -> Path:
    return path / "speech_tokenizer" / "model.safetensors"


def _tokenizer_config(path: Path) -> dict[str, Any]:
    settings: dict[str, Any] = json.loads((path / "speech_tokenizer" / "config.json").read_text())
    return settings
