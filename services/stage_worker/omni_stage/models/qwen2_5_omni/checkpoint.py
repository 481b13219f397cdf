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
)

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


def _config(ids: dict[str, int], vocab: int) -> Any:
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION}
    media = {  # where the thinker and the talker find media placeholders and their bounds
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    thinker = {
        "audio_config": {**AUDIO_ENCODER, "n_window": 100},
        "vision_config": {
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
        "text_config": {
            "vocab_size": vocab,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": 1,
            "max_position_embeddings": 8192,
            "rope_parameters": rope,
            "tie_word_embeddings": False,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            # transformers' 0.02 makes a reply that barely depends on the prompt: every prompt
            # and image began with the same seven tokens (tests/unit/test_tiny_checkpoints.py).
            "initializer_range": 0.3,
        },
        **media,
        "user_token_id": ids["<|im_start|>"],
        "initializer_range": 0.5,
    }
    talker = {
        "vocab_size": CODEC_VOCAB,
        "embedding_size": HIDDEN,
        **LAYERS,
        "rope_parameters": rope,
        **media,
        "tts_text_start_token_id": ids["<|tts_text_bos|>"],
        "tts_text_end_token_id": ids["<|tts_text_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "tts_codec_start_token_id": CODEC_START,
        "tts_codec_end_token_id": CODEC_END,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        "initializer_range": 0.5,
    }
    token2wav = {
        "dit_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "ff_mult": 2,
            "emb_dim": 32,
            "num_embeds": CODEC_VOCAB,
            "mel_dim": MEL_DIM,
            "repeats": 2,
            "block_size": 24,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
            "max_position_embeddings": 8192,
            "enc_emb_dim": SPEAKER_DIM,
            "enc_dim": 16,
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_attention_channels": 16,
            "enc_se_channels": 16,
        },
        "bigvgan_config": {
            "mel_dim": MEL_DIM,
            "upsample_initial_channel": 64,
            "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2],  # 240 samples a mel frame, 2 frames a code: 24 kHz
            "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )


def write_tiny_checkpoint(path: Path, seed: int = 5) -> Path:
    """Write tiny-qwen2.5-omni into `path` (a directory); returns it."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    # The special tokens after the codec's codes, as in the real vocabulary (151k ids).
    tok = byte_level_tokenizer(CHAT_TEMPLATE, SPECIAL_TOKENS, TOKEN_ROLES, ordinary=CODEC_VOCAB)
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    torch.manual_seed(seed)
    model = new_model(Qwen2_5OmniForConditionalGeneration, _config(ids, len(tok)))
    keep_specials_out_of_replies(model.thinker.lm_head, ids.values())
    keep_the_waveform(model.token2wav.code2wav_bigvgan_model)  # BigVGAN
    save_checkpoint(path, model, tok, ids, VISION, "Qwen2_5OmniProcessor", CHAT_TEMPLATE)
    gen = torch.Generator().manual_seed(seed)
    speakers = {
        voice: {
            "bos_token": ids[f"<|spk_{voice.lower()}|>"],
            # A batch of one, as the real file holds them ([1, 192], [1, frames, 80]); drawn wide
            # enough that the voice changes the speech through random weights.
            "cond": torch.randn(1, SPEAKER_DIM, generator=gen) * 4.0,
            "ref_mel": torch.randn(1, 40, MEL_DIM, generator=gen) * 4.0,
        }
        for voice in VOICES
    }
    torch.save(speakers, path / "spk_dict.pt")
    return path
