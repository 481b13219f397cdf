"""tiny-qwen2.5-omni: a genuine Qwen2.5-Omni checkpoint with tiny dimensions and random weights.

Built from transformers' own config classes and saved with `save_pretrained`, so it loads with
`Qwen2_5OmniForConditionalGeneration.from_pretrained` and carries the files a real checkpoint
has: config and generation config, safetensors, a tokenizer with Qwen's special tokens (audio,
image and video pads with their bos/eos, the TTS text tokens, one bos token per voice), the chat
template, the audio feature extractor's and image/video processors' settings in
`preprocessor_config.json` and `video_preprocessor_config.json`, and `spk_dict.pt` with the
voices Chelsie and Ethan. The ordinary tokens are the printable characters and their pairs, as
many as the codec has codes, and the special tokens come after them, as in the real vocabulary
(~151k ids): no code the talker emits reads as a media placeholder. Every config that names a
token id says which.

Sizes: hidden 64 with head_dim 32 (the smallest vLLM's CPU attention takes), two layers per
transformer, the real codec vocabulary (8448) so the talker's special codes keep their real ids;
the DiT embeds all 8448 codes (the real one only 8193 codec entries: random weights may pick any).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_stage.demo_tokenizer import byte_level_tokenizer
from omni_stage.models.qwen_omni.checkpoint import (
    AUDIO_ENCODER,
    HEADS,
    HIDDEN,
    LAYERS,
    VISION,
    keep_specials_out_of_replies,
    keep_the_waveform,
    new_model,
    save_checkpoint,
    write_config_files,
    write_dummy_weights,
)
from omni_stage.models.qwen_omni.checkpoint import Sizes as FamilySizes

MROPE_SECTION: Final = [4, 6, 6]  # sums to head_dim / 2, as [16, 24, 24] does for 128
CODEC_VOCAB: Final = 8448
CODEC_PAD, CODEC_START, CODEC_END, CODEC_MASK = 8292, 8293, 8294, 8296  # the real ids
MEL_DIM: Final = 80
SPEAKER_DIM: Final = 16  # the DiT's ECAPA embedding (192 in the real model)
VOICES: Final = ("Chelsie", "Ethan")

SPECIAL_TOKENS: Final = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|tts_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eod|>",
    *(f"<|spk_{v.lower()}|>" for v in VOICES),
]
TOKEN_ROLES: Final = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
SYSTEM_PROMPT: Final = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
# Qwen2.5-Omni's template: a content list of text, audio, image and video parts, each media
# part as its placeholder between its bos/eos tokens.
CHAT_TEMPLATE: Final = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    + SYSTEM_PROMPT
    + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Sizes(FamilySizes):
    """Its dimensions, tiny (the demo's) or Qwen2.5-Omni-7B's (FULL_SIZE), with its speech parts'."""

    dit: dict[str, Any]
    bigvgan: dict[str, Any]
    speaker_dim: int
    """The DiT's ECAPA speaker embedding: a voice's `cond` in spk_dict.pt."""
    tiny_init: bool
    """Weights drawn wider than transformers' init (the tiny model's: see _config)."""


TINY: Final = Sizes(
    thinker={
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
    },
    thinker_vocab=None,
    audio={**AUDIO_ENCODER, "n_window": 100},
    vision={
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": HIDDEN,
        "fullatt_block_indexes": [1],
        "window_size": 112,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    talker={"embedding_size": HIDDEN, **LAYERS},
    dit={
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "emb_dim": 32,
        "look_ahead_layers": [1],
        "look_backward_layers": [0],
        "max_position_embeddings": 8192,
        "enc_dim": 16,
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_attention_channels": 16,
        "enc_se_channels": 16,
    },
    bigvgan={
        "upsample_initial_channel": 16,
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        # The same 240 samples a mel frame in two stages, not six: a third of the operations,
        # which halves what compiling it costs (tests/unit/test_qwen_omni.py's compiled
        # code2wav), and eager decoding is no slower (docs/development.md).
        "upsample_rates": [16, 15],
        "upsample_kernel_sizes": [32, 31],
    },
    mrope_section=MROPE_SECTION,
    speaker_dim=SPEAKER_DIM,
    tiny_init=True,
)

FULL_SIZE: Final = Sizes(  # Qwen2.5-Omni-7B's config.json
    thinker={
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
    },
    thinker_vocab=152064,
    audio={
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "output_dim": 3584,
        "max_source_positions": 1500,
        "n_window": 100,
    },
    vision={
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "window_size": 112,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    talker={
        "embedding_size": 3584,
        "hidden_size": 896,
        "intermediate_size": 18944,
        "num_hidden_layers": 24,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 32768,
    },
    dit={
        "hidden_size": 1024,
        "num_hidden_layers": 22,
        "num_attention_heads": 16,
        "head_dim": 64,
        "emb_dim": 512,
        "look_ahead_layers": [10],
        "look_backward_layers": [0, 20],
        "max_position_embeddings": 32768,
        "enc_dim": 128,
        "enc_channels": [256, 256, 256, 256, 768],
        "enc_attention_channels": 64,
        "enc_se_channels": 64,
    },
    bigvgan={
        "upsample_initial_channel": 1536,
        "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2],  # 240 samples a mel frame, 2 frames a code: 24 kHz
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    },
    mrope_section=[16, 24, 24],
    speaker_dim=192,
    tiny_init=False,
)


def _config(ids: dict[str, int], vocab: int, sizes: Sizes = TINY) -> Any:
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sizes.mrope_section}
    media = {  # where the thinker and the talker find media placeholders and their bounds
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    # transformers' 0.02 makes a tiny reply that barely depends on the prompt: every prompt and
    # image began with the same seven tokens (tests/unit/test_tiny_checkpoints.py).
    wide = {"initializer_range": 0.5} if sizes.tiny_init else {}
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
            **({"initializer_range": 0.3} if sizes.tiny_init else {}),
        },
        **media,
        "user_token_id": ids["<|im_start|>"],
        **wide,
    }
    talker = {
        "vocab_size": CODEC_VOCAB,
        **sizes.talker,
        "rope_parameters": rope,
        **media,
        "tts_text_start_token_id": ids["<|tts_text_bos|>"],
        "tts_text_end_token_id": ids["<|tts_text_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "tts_codec_start_token_id": CODEC_START,
        "tts_codec_end_token_id": CODEC_END,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        **wide,
    }
    token2wav = {
        "dit_config": {
            **sizes.dit,
            "ff_mult": 2,
            # Every code the talker has (the real DiT embeds 8193): random weights may pick any.
            "num_embeds": CODEC_VOCAB,
            "mel_dim": MEL_DIM,
            "repeats": 2,
            "block_size": 24,
            "enc_emb_dim": sizes.speaker_dim,
        },
        "bigvgan_config": {
            "mel_dim": MEL_DIM,
            **sizes.bigvgan,
        },
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )


def _tokenizer() -> Any:
    # The special tokens after the codec's codes, as in the real vocabulary (151k ids).
    return byte_level_tokenizer(CHAT_TEMPLATE, SPECIAL_TOKENS, TOKEN_ROLES, ordinary=CODEC_VOCAB)


def _speakers(path: Path, ids: dict[str, int], dim: int, seed: int) -> None:
    """spk_dict.pt: each voice's bos token and conditioning."""
    gen = torch.Generator().manual_seed(seed)
    speakers = {
        voice: {
            "bos_token": ids[f"<|spk_{voice.lower()}|>"],
            # A batch of one, as the real file holds them ([1, 192], [1, frames, 80]); drawn wide
            # enough that the voice changes the speech through random weights.
            "cond": torch.randn(1, dim, generator=gen) * 4.0,
            "ref_mel": torch.randn(1, 40, MEL_DIM, generator=gen) * 4.0,
        }
        for voice in VOICES
    }
    torch.save(speakers, path / "spk_dict.pt")


def write_tiny_checkpoint(path: Path, seed: int = 5) -> Path:
    """Write tiny-qwen2.5-omni into `path` (a directory); returns it."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    tok = _tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    torch.manual_seed(seed)
    model = new_model(Qwen2_5OmniForConditionalGeneration, _config(ids, len(tok)))
    keep_specials_out_of_replies(model.thinker.lm_head, ids.values())
    keep_the_waveform(model.token2wav.code2wav_bigvgan_model)  # BigVGAN
    save_checkpoint(path, model, tok, ids, VISION, "Qwen2_5OmniProcessor", CHAT_TEMPLATE)
    _speakers(path, ids, SPEAKER_DIM, seed)
    return path


def write_config_only(path: Path, sizes: Sizes = FULL_SIZE) -> Path:
    """Write a Qwen2.5-Omni checkpoint without its weights into `path` (a directory; returns it):
    the config at `sizes` (by default Qwen2.5-Omni-7B's), the demo's tokenizer, processor files
    and voices. Its stages serve with `loadFormat: dummy` (random weights built on the device),
    for speed measurements where the weights cannot be fetched. A reply is noise."""
    tok = _tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    path.mkdir(parents=True, exist_ok=True)
    write_config_files(
        path, _config(ids, len(tok), sizes), tok, ids, VISION, "Qwen2_5OmniProcessor", CHAT_TEMPLATE
    )
    _speakers(path, ids, sizes.speaker_dim, 5)
    return path


def write_random(
    path: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard: str = "5GB",
    sizes: Sizes = FULL_SIZE,
) -> Path:
    """`write_config_only`'s checkpoint with its weights, as Qwen2.5-Omni-7B's files hold them
    (`omni models init-random`): those `loadFormat: dummy` builds, written in safetensors shards
    (qwen_omni.checkpoint.write_dummy_weights). About 22 GB at bfloat16."""
    from transformers import (
        Qwen2_5OmniForConditionalGeneration,
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    parts = {  # the classes the stages load (thinker.py, speech.py)
        "thinker": (Qwen2_5OmniThinkerForConditionalGeneration, "thinker_config"),
        "talker": (Qwen2_5OmniTalkerForConditionalGeneration, "talker_config"),
        "token2wav": (Qwen2_5OmniToken2WavModel, "token2wav_config"),
    }
    write_config_only(path, sizes)
    return write_dummy_weights(path, Qwen2_5OmniForConditionalGeneration, parts, device, dtype, shard)
