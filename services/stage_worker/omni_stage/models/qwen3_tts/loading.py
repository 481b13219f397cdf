"""Reading a Qwen3-TTS checkpoint directory as the real one is laid out: config.json, the
`talker.` tensors of model.safetensors (a stage that speaks loads no speaker encoder), and
speech_tokenizer/ (`decoder.` only: the encoder is for cloning). Strict: a tensor missing or left
over is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

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
    tokenizer = path / "speech_tokenizer"
    settings = json.loads((tokenizer / "config.json").read_text())
    decoder = SpeechDecoder(settings["decoder_config"])
    decoder.load_state_dict(_tensors(tokenizer / "model.safetensors", "decoder."), strict=True)
    return decoder.to(device, torch.float32).eval()
