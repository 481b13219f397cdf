"""Qwen3-TTS's talker and speech decoder, loaded from a checkpoint directory, and the talker's
greedy frames as the reference's `generate` draws them.

Loading reads the real files: config.json, the `talker.` tensors of model.safetensors (a stage
that speaks loads no speaker encoder), and speech_tokenizer/ (`decoder.` only: the encoder is
for cloning). Strict: a tensor missing or left over is an error naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from omni_stage.models.qwen3_omni.code_predictor import StaticFrames, frame_embedding
from omni_stage.models.qwen3_tts.modeling import SpeechDecoder, Talker
from omni_stage.models.qwen3_tts.prompt import TTSIds, TTSPrompt
from omni_stage.models.qwen_omni.parts import penalise_repeats

SUPPRESSED_TOP: Final = 1024
"""The top of the codec's vocabulary (its control codes), never drawn but its eos."""
MIN_CODES: Final = 2
"""The reference's `min_new_tokens`: the eos is not drawn before two codes."""


def read_config(path: Path) -> dict[str, Any]:
    settings: dict[str, Any] = json.loads((path / "config.json").read_text())
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


@dataclass(slots=True)
class Speaking:
    """One request's talker state: its cache, the hidden state that drew code 0 of the frame
    under way, the codes 0 drawn so far, and the frames finished."""

    prompt: TTSPrompt
    past: Any = None
    hidden: torch.Tensor | None = None
    code0: int = 0
    seen: list[int] = field(default_factory=list)
    frames: list[list[int]] = field(default_factory=list)


class TTSTalker:
    """The talker's steps for one request at a time, greedy, as the reference draws: the prompt's
    prefill, then per frame the code predictor's residuals (StaticFrames, shared with Qwen3-
    Omni's talker) and the next step fed the frame's codes and the next text row."""

    def __init__(self, talker: Talker, ids: TTSIds, frames: StaticFrames) -> None:
        self.talker = talker
        self.ids = ids
        self.frames = frames
        vocab = talker.config.vocab_size
        self.suppressed = [i for i in range(vocab - SUPPRESSED_TOP, vocab) if i != ids.codec_eos]

    @torch.inference_mode()
    def speak(self, prompt: TTSPrompt, budget: int) -> list[list[int]]:
        """Every frame [16 codes] until the codec's eos, or as many as `budget` codes 0 allow
        (the last code drawn has no residuals)."""
        from transformers import DynamicCache

        st = Speaking(prompt, past=DynamicCache())
        self._step(st, prompt.inputs)
        while st.code0 != self.ids.codec_eos and len(st.seen) < budget:
            residuals = self.frames.residuals(st.hidden, [st.code0])[0]  # type: ignore[arg-type]
            codes = [st.code0, *residuals]
            st.frames.append(codes)
            k = len(st.frames) - 1
            text = prompt.trailing[:, k : k + 1] if k < prompt.trailing.shape[1] else prompt.pad
            self._step(st, frame_embedding(self.talker, codes) + text)
        return st.frames

    def _step(self, st: Speaking, inputs: torch.Tensor) -> None:
        at = st.past.get_seq_length()
        positions = torch.arange(at, at + inputs.shape[1], device=inputs.device)[None]
        out = self.talker.model(
            inputs_embeds=inputs, position_ids=positions, past_key_values=st.past, use_cache=True
        )
        st.past = out.past_key_values
        st.hidden = out.last_hidden_state[:, -1:]
        logits = penalise_repeats(self.talker.codec_head(st.hidden)[0, -1].float(), st.seen)
        logits[self.suppressed] = -float("inf")
        if len(st.seen) < MIN_CODES:
            logits[self.ids.codec_eos] = -float("inf")
        st.code0 = int(torch.argmax(logits))
        st.seen.append(st.code0)
