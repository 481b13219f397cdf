"""tiny-qwen3-omni: a genuine Qwen3-Omni checkpoint with tiny dimensions and random weights.

Built from transformers' own config classes and saved with `save_pretrained`, so it loads with
`Qwen3OmniMoeForConditionalGeneration.from_pretrained` (and its thinker with vLLM), with the
files a real checkpoint has: config, generation config, safetensors, a tokenizer with Qwen3-
Omni's special tokens (`<|audio_pad|>`, `<|image_pad|>`, `<|video_pad|>` and their start/end,
the TTS pad/bos/eos) and its role words `system`, `user`, `assistant` as single tokens (the
talker finds the turns by them, as by the real vocabulary's), the chat template, and the
feature extractor's, image and video processors' settings. The ordinary tokens are the
printable characters and their pairs, as many as the codec has codes, and the special tokens
come after them, as in the real vocabulary: no code the talker emits reads as a media
placeholder. Every config that names a token id says which.

Sizes: hidden 64 with head_dim 32, two layers per transformer, 4 experts (2 a token) in the
thinker's and the talker's MoE layers, 4 codebooks (the real model has 16), the real codec
vocabulary (3072: the control codes keep their ids) and Code2Wav's real upsampling (1920
samples a code at 24 kHz).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_stage.demo_tokenizer import byte_level_tokenizer
from omni_stage.models.qwen_omni.checkpoint import (
    AUDIO_ENCODER,
    HIDDEN,
    LAYERS,
    keep_specials_out_of_replies,
    keep_the_waveform,
    new_model,
    save_checkpoint,
    write_config_files,
    write_dummy_weights,
)
from omni_stage.models.qwen_omni.checkpoint import VISION as QWEN2_5_VISION
from omni_stage.models.qwen_omni.checkpoint import Sizes as FamilySizes

GROUPS: Final = 4
CODEC_VOCAB: Final = 3072
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150  # the real ids
NOTHINK, THINK_BOS, THINK_EOS = 2155, 2156, 2157
SPEAKERS: Final = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
SPECIAL_TOKENS: Final = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
]
ROLE_WORDS: Final = ["system", "user", "assistant"]
TOKEN_ROLES: Final = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# Qwen3-Omni's template, without a default system prompt: content parts in order, each media
# part as its pad between its start and end tokens.
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer() -> Any:
    # The special tokens after the codec's codes, as in the real vocabulary (151k ids).
    tok = byte_level_tokenizer(CHAT_TEMPLATE, SPECIAL_TOKENS, TOKEN_ROLES, ordinary=CODEC_VOCAB)
    tok.add_tokens(ROLE_WORDS)
    return tok


@dataclass(frozen=True, slots=True)
class Sizes(FamilySizes):
    """Its dimensions, tiny (the demo's) or Qwen3-Omni-30B-A3B's (FULL_SIZE), with its speech parts'."""

    code_predictor: dict[str, Any]
    code2wav: dict[str, Any]
    groups: int
    accept_hidden_layer: int
    initializer_range: float | None


TINY: Final = Sizes(
    thinker={**LAYERS, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    thinker_vocab=None,
    audio={
        **AUDIO_ENCODER,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
        "downsample_hidden_size": 32,
    },
    vision={
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": 2304,
        # What vLLM reads of it, as the real config says it: sqrt(num_position_embeddings)
        # patches a side, and an absolute position embedding (transformers always has one).
        "image_size": 768,
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [0],
    },
    talker={
        **LAYERS,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "shared_expert_intermediate_size": 32,
    },
    code_predictor={**LAYERS, "num_hidden_layers": 1},
    code2wav={
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "decoder_dim": 32,
    },
    mrope_section=[4, 6, 6],
    groups=GROUPS,
    accept_hidden_layer=1,
    initializer_range=0.5,
)

FULL_SIZE: Final = Sizes(  # Qwen3-Omni-30B-A3B-Instruct's config.json
    thinker={
        "hidden_size": 2048,
        "intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 65536,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
    },
    thinker_vocab=152064,
    audio={
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "output_dim": 2048,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
        "downsample_hidden_size": 480,
    },
    vision={
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
        "image_size": 768,
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    talker={
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 20,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 65536,
        "moe_intermediate_size": 384,
        "num_experts": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 6,
        "shared_expert_intermediate_size": 768,
    },
    code_predictor={
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 5,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
    },
    code2wav={
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 8,
        "intermediate_size": 3072,
        "decoder_dim": 1536,
    },
    mrope_section=[24, 20, 20],
    groups=16,
    accept_hidden_layer=24,
    initializer_range=None,
)


def _config(ids: dict[str, int], vocab: int, sizes: Sizes = TINY) -> Any:
    from transformers import Qwen3OmniMoeConfig

    rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": sizes.mrope_section,
        "interleaved": True,
    }
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "position_id_per_seconds": 13,
    }
    if sizes.initializer_range is not None:
        media["initializer_range"] = sizes.initializer_range
    thinker = {
        "audio_config": sizes.audio,
        "vision_config": sizes.vision,
        "text_config": {
            "vocab_size": sizes.thinker_vocab or vocab,
            **sizes.thinker,
            "rope_parameters": rope,
            "tie_word_embeddings": False,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        **media,
        "user_token_id": ids["user"],
    }
    talker = {
        "text_config": {"vocab_size": CODEC_VOCAB, **sizes.talker, "rope_parameters": rope},
        "code_predictor_config": {
            "vocab_size": 2048,
            **sizes.code_predictor,
            "num_code_groups": sizes.groups,
        },
        **media,
        "num_code_groups": sizes.groups,
        "thinker_hidden_size": sizes.thinker["hidden_size"],
        "accept_hidden_layer": sizes.accept_hidden_layer,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": NOTHINK,
        "codec_think_bos_id": THINK_BOS,
        "codec_think_eos_id": THINK_EOS,
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "speaker_id": SPEAKERS,
        "spatial_merge_size": 2,
    }
    code2wav = {
        "codebook_size": 2048,
        **sizes.code2wav,
        "sliding_window": 72,
        "num_quantizers": sizes.groups,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "max_position_embeddings": 8000,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"],
        tts_bos_token_id=ids["<|tts_bos|>"],
        tts_eos_token_id=ids["<|tts_eos|>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )


VISION: Final = {  # Qwen3-Omni's image and video processors: 16-pixel patches
    **QWEN2_5_VISION,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 4096,
    "max_pixels": 16777216,
    "patch_size": 16,
}


def write_tiny_checkpoint(path: Path, seed: int = 5) -> Path:
    """Write tiny-qwen3-omni into `path` (a directory); returns it."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts

    tok = tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS + ROLE_WORDS}
    torch.manual_seed(seed)
    model = new_model(Qwen3OmniMoeForConditionalGeneration, _config(ids, len(tok)))
    keep_specials_out_of_replies(model.thinker.lm_head, ids.values())
    with torch.no_grad():
        # Random weights drown one position of the talker's prompt: make each voice's speaker
        # code stand out, so the voice changes the speech, as it does in the trained model.
        for code in SPEAKERS.values():
            model.talker.get_input_embeddings().weight[code].mul_(20.0)
    keep_the_waveform(model.code2wav)
    with torch.no_grad():
        # transformers (5.19) initialises the thinker's experts but not the talker's: they hold
        # whatever memory torch.empty gave them, a different checkpoint every time. Draw them
        # from the seed as the thinker's are drawn (normal, the config's initializer range).
        std = model.config.talker_config.initializer_range
        gen = torch.Generator().manual_seed(seed)
        for module in model.talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                module.gate_up_proj.normal_(0.0, std, generator=gen)
                module.down_proj.normal_(0.0, std, generator=gen)
    save_checkpoint(path, model, tok, ids, VISION, "Qwen3OmniMoeProcessor", CHAT_TEMPLATE)
    return path


def write_config_only(path: Path, sizes: Sizes = FULL_SIZE) -> Path:
    """Write a Qwen3-Omni checkpoint without its weights into `path` (a directory; returns it):
    the config at `sizes` (by default Qwen3-Omni-30B-A3B's, whose weights take 70 GB), the
    demo's tokenizer and processor files. Its stages serve with `loadFormat: dummy` (random
    weights built on the device): what a speed measurement needs on a machine with no network
    and a smaller disk. A reply is noise."""
    tok = tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS + ROLE_WORDS}
    write_config_files(
        path, _config(ids, len(tok), sizes), tok, ids, VISION, "Qwen3OmniMoeProcessor", CHAT_TEMPLATE
    )
    return path


def write_random(
    path: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard: str = "5GB",
    sizes: Sizes = FULL_SIZE,
) -> Path:
    """`write_config_only`'s checkpoint with its weights, as Qwen3-Omni-30B-A3B's files hold
    them, each expert's apart (`omni models init-random`): those `loadFormat: dummy` builds,
    written in safetensors shards (qwen_omni.checkpoint.write_dummy_weights). About 70 GB at
    bfloat16, and as much memory on `device` while it is written."""
    from transformers import (
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeTalkerForConditionalGeneration,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omni_stage.models.qwen3_omni.speech import register_talker_moe_conversion

    register_talker_moe_conversion()  # its experts written apart, as loading fuses them
    parts = {  # the classes the stages load (thinker.py, speech.py, code2wav.py)
        "thinker": (Qwen3OmniMoeThinkerForConditionalGeneration, "thinker_config"),
        "talker": (Qwen3OmniMoeTalkerForConditionalGeneration, "talker_config"),
        "code2wav": (Qwen3OmniMoeCode2Wav, "code2wav_config"),
    }
    write_config_only(path, sizes)
    return write_dummy_weights(path, Qwen3OmniMoeForConditionalGeneration, parts, device, dtype, shard)
