"""The tiny demo models: built offline in seconds, loaded back with the normal loading code.

- tiny-thinker: a Qwen2 causal LM with random weights and a byte-level BPE tokenizer (printable
  ASCII only, so whatever it says is readable) with a chat template; returns hidden states.
- tiny-talker: a Qwen2 causal LM over 256 codec tokens, fed the thinker's hidden states.
- tiny-vocoder: codec tokens -> 24 kHz waveform, 480 samples per code (a small conv decoder).
- tiny-qwen2.5-omni: a genuine Qwen2.5-Omni checkpoint (thinker, talker, token2wav), see
  omni_stage.models.qwen2_5_omni.checkpoint.
- tiny-image: a diffusers pipeline directory of a PixArt-alpha transformer (its captions are the
  thinker's hidden states, so tiny-thinker is its text encoder), a DPM-Solver scheduler and a
  KL VAE with 4x downsampling: images in multiples of 8 pixels.
- tiny-video: a diffusers Wan 2.1 text-to-video pipeline directory (UMT5 text encoder, Wan 3D
  transformer, Wan VAE, UniPC flow scheduler), complete, so diffusers' `WanPipeline` loads it.
- tiny-image-edit: a diffusers Qwen-Image-Edit pipeline directory (Qwen2.5-VL text and vision
  encoder with its processor, Qwen-Image transformer, Qwen-Image VAE, flow-matching Euler
  scheduler), complete, so diffusers' `QwenImageEditPipeline` loads it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Final

import torch
from safetensors.torch import load_file, save_file

from omni_stage.checkpoint_files import readable_as_other_files
from omni_stage.demo_tokenizer import byte_level_tokenizer
from omni_stage.engines.base import import_object
from omni_stage.engines.registry import DIFFUSERS_FAMILIES, FAMILIES

log = logging.getLogger(__name__)

HIDDEN: Final = 64
CODEC_VOCAB: Final = 256
SAMPLE_RATE: Final = 24000
HOP: Final = 480
VOICES: Final = ("alloy", "echo")
"""The demo vocoder's voices (two of OpenAI's names, so OpenAI's examples run), its default first."""

CHAT_TEMPLATE: Final = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyVocoder(torch.nn.Module):
    """Codec tokens [batch, n] -> waveforms [batch, n * hop] in [-1, 1], in one of its voices
    (a learned speaker embedding added to every frame, as multi-speaker vocoders condition)."""

    batched = True  # the torch engine stacks concurrent requests' windows into one call

    def __init__(
        self,
        vocab: int = CODEC_VOCAB,
        dim: int = 32,
        hop: int = HOP,
        sample_rate: int = SAMPLE_RATE,
        voices: tuple[str, ...] = VOICES,
    ):
        super().__init__()
        self.sample_rate = sample_rate
        self.voices = tuple(voices)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.speaker = torch.nn.Embedding(len(self.voices), dim)
        self.conv = torch.nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.up = torch.nn.ConvTranspose1d(dim, 1, kernel_size=hop, stride=hop)

    def forward(self, token_ids: torch.Tensor, speed: float = 1.0, voice: str = VOICES[0]) -> torch.Tensor:
        x = self.embed(token_ids.long())  # [batch, n, dim]
        x = (x + self.speaker.weight[self.voices.index(voice)]).transpose(1, 2)  # [batch, dim, n]
        if speed != 1.0:  # fewer or more frames, each still `hop` samples: faster speech, same pitch
            frames = max(1, round(x.shape[-1] / speed))
            x = torch.nn.functional.interpolate(x, size=frames, mode="linear", align_corners=False)
        x = torch.nn.functional.gelu(self.conv(x))
        return torch.tanh(self.up(x)).flatten(1)


def vocoder(path: str) -> TinyVocoder:
    """Factory for the torch engine: `omni_stage.demo:vocoder` with args {path: DIR}."""
    cfg = json.loads(Path(path, "config.json").read_text())
    model = TinyVocoder(**cfg)
    model.load_state_dict(load_file(str(Path(path, "model.safetensors"))))
    return model


def _qwen2(vocab: int, eos: int | None, seed: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention takes
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.5,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=eos,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    if eos is not None:
        with torch.no_grad():
            # Random weights would end answers at random; keep the stop token rare so the
            # demo speaks until max_tokens (greedy never picks a zero logit here).
            model.lm_head.weight[eos].zero_()
    return model


def init_demo(out_dir: str | Path) -> dict[str, Path]:
    """Write tiny-thinker, tiny-talker, tiny-vocoder and each model family's tiny checkpoint (the
    registry's FAMILIES and DIFFUSERS_FAMILIES: tiny-qwen2.5-omni, tiny-qwen3-omni, tiny-video,
    tiny-image-edit, and tiny-image last: its index means all are there) under `out_dir`;
    returns their paths, by name without `tiny-`. A family that needs a package not installed
    here (`Family.needs`) is left out, with a warning naming it. The weight files are left
    readable as the configs beside them are (checkpoint_files.py)."""
    out = Path(out_dir)
    families = (f.demo for f in (*FAMILIES.values(), *DIFFUSERS_FAMILIES.values()))
    names = ("thinker", "talker", "vocoder", *families)
    paths = {name: out / f"tiny-{name}" for name in names}

    tok = byte_level_tokenizer(CHAT_TEMPLATE, ["<|im_start|>"])
    thinker = _qwen2(len(tok), tok.convert_tokens_to_ids("<|im_end|>"), seed=0)
    thinker.save_pretrained(paths["thinker"])
    tok.save_pretrained(paths["thinker"])

    talker = _qwen2(CODEC_VOCAB, None, seed=1)
    talker.save_pretrained(paths["talker"])

    torch.manual_seed(2)
    voc = TinyVocoder()
    paths["vocoder"].mkdir(parents=True, exist_ok=True)
    (paths["vocoder"] / "config.json").write_text(
        json.dumps(
            {"vocab": CODEC_VOCAB, "dim": 32, "hop": HOP, "sample_rate": SAMPLE_RATE, "voices": VOICES}
        )
    )
    save_file(voc.state_dict(), str(paths["vocoder"] / "model.safetensors"))

    for family in (*FAMILIES.values(), *DIFFUSERS_FAMILIES.values()):  # tiny-image last
        if missing := family.missing():
            log.warning(
                "tiny-%s not written: %s needs %s, not installed here (`make test` installs it)",
                family.demo,
                family.name,
                ", ".join(missing),
            )
            del paths[family.demo]
            continue
        import_object(family.checkpoint)(paths[family.demo])
    for written in out.glob("tiny-*"):  # (a family may write more than its own: Qwen3-TTS's variants)
        readable_as_other_files(written)
    return paths
