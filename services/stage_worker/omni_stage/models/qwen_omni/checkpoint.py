"""What the tiny Qwen-Omni checkpoints of both families share: building the model at random weights,
keeping its replies printable and its waveform audible, and the files a real checkpoint holds
beside its weights (tokenizer, processor settings, chat template)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

HIDDEN: Final = 64
"""The thinkers' hidden size (the real ones: 3584, 2048)."""
HEADS: Final = 2  # head_dim 32
LAYERS: Final = {  # a tiny decoder's layers (the talkers', Qwen3-Omni's thinker's)
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "head_dim": HIDDEN // HEADS,
    "max_position_embeddings": 8192,
}
AUDIO_ENCODER: Final = {  # both families' audio encoders, tiny; each adds its windowing
    # Drawn wider than transformers' 0.02, as the thinkers' decoders are: at 0.02 random weights
    # make every clip the same to the thinker (tests/unit/test_tiny_checkpoints.py).
    "initializer_range": 0.3,
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "output_dim": HIDDEN,
    "max_source_positions": 1500,
}


def new_model(cls: Any, config: Any) -> Any:
    """transformers' `cls` at random weights (seeded by the caller), in eval mode."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the default sub-configs it builds first name ~151k ids
    try:
        return cls(config).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def keep_specials_out_of_replies(lm_head: torch.nn.Linear, ids: Iterable[int]) -> None:
    """Random weights would end answers at random, or with media placeholders: with these
    tokens' logits at zero, greedy speaks printable text until max_tokens."""
    with torch.no_grad():
        for i in ids:
            lm_head.weight[i].zero_()


def keep_the_waveform(vocoder: torch.nn.Module) -> None:
    """The vocoders' own init (std 0.02) shrinks the signal through their upsampling convolutions
    to ~1e-8: PyTorch's default init keeps a real waveform (peak ~0.5)."""
    for module in vocoder.modules():
        if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
            module.reset_parameters()


def save_checkpoint(
    path: Path,
    model: Any,
    tok: Any,
    ids: dict[str, int],
    vision: dict[str, Any],
    processor: str,
    template: str,
) -> None:
    """The model's weights and config, its generation config's eos and pad, the tokenizer, and
    the processor's files."""
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    write_config_files(path, model.config, tok, ids, vision, processor, template)
    model.save_pretrained(path)  # its config and its whole generation config over those


def write_config_files(
    path: Path,
    config: Any,
    tok: Any,
    ids: dict[str, int],
    vision: dict[str, Any],
    processor: str,
    template: str,
) -> None:
    """What `save_checkpoint` writes but the weights (`loadFormat: dummy` builds those)."""
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForConditionalGeneration"]
    config.save_pretrained(path)
    GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]).save_pretrained(path)
    tok.save_pretrained(path)
    processor_files(path, vision, processor, template)


def write_dummy_weights(
    path: Path, whole: Any, parts: dict[str, tuple[Any, str]], device: str, dtype: torch.dtype, shard: str
) -> Path:
    """Into the config-only checkpoint at `path`, the weights `loadFormat: dummy` builds for each
    part (`parts`: its name in the whole model, the transformers class its stage loads and the
    sub-config's name), written as a released checkpoint holds them: the whole model's (`whole`,
    its transformers class) safetensors shards of at most `shard` each, and their index. The
    whole model is built on the meta device, so only the parts take memory, on `device`; and
    transformers writes what it fuses at loading (the MoE experts) apart again, as the released
    files have them. Each stage then reads with `loadFormat: auto` the very weights it builds
    with `dummy`, through the real loading code (all but a talker's TTS rows of the thinker's
    embedding table, which `dummy` draws apart)."""
    from transformers import GenerationConfig

    from omni_stage.checkpoint_files import readable_as_other_files
    from omni_stage.models.qwen_omni.parts import dummy_model

    config = whole.config_class.from_pretrained(path)
    with torch.device("meta"):
        model = whole._from_config(config, dtype=dtype)
    for name, (cls, sub) in parts.items():
        setattr(model, name, dummy_model(cls, getattr(config, sub), torch.device(device), dtype))
    model.generation_config = GenerationConfig.from_pretrained(path)  # the eos and pad written beside
    model.save_pretrained(path, max_shard_size=shard)
    readable_as_other_files(path)
    return path


@dataclass(frozen=True, slots=True)
class Sizes:
    """A family's dimensions, tiny (its demo's) or its real model's: what both families' have;
    each adds its speech parts'."""

    thinker: dict[str, Any]
    """The thinker's decoder."""
    thinker_vocab: int | None
    """The thinker's vocabulary: None for the tokenizer's own (the tiny models')."""
    audio: dict[str, Any]
    vision: dict[str, Any]
    talker: dict[str, Any]
    mrope_section: list[int]


def processor_files(path: Path, vision: dict[str, Any], processor: str, chat_template: str) -> None:
    """What a real Qwen-Omni checkpoint holds for its processor: the Whisper feature
    extractor's settings and the Qwen2-VL image processor's (`vision`) in one
    preprocessor_config.json, the video processor's own file, and the chat template."""
    from transformers import WhisperFeatureExtractor

    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300)
    merged = {
        **audio.to_dict(),
        **vision,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        "return_attention_mask": True,
    }
    merged.pop("mel_filters", None)  # derived from the settings above on load
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    video = {**vision, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": processor}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2))


VISION: Final = {  # Qwen2.5-Omni's image and video processors (Qwen3-Omni's change the patches)
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
