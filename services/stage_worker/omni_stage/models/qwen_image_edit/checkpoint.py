"""tiny-image-edit: a Qwen-Image-Edit pipeline directory with tiny dimensions and random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch

from omni_stage.demo_tokenizer import byte_level_tokenizer

HIDDEN: Final = 64
"""The reading model's width, and so the MMDiT's joint attention's."""


def write_tiny_checkpoint(path: Path) -> Path:
    """A Qwen-Image-Edit pipeline directory as diffusers' `QwenImageEditPipeline` loads it: the
    Qwen2.5-VL model that reads the instruction with the image (the demo tokenizer with
    Qwen's vision tokens; its processor reads at most 112x112 pixels), the Qwen-Image MMDiT,
    the Qwen-Image VAE (8x in space) and the scheduler with Qwen-Image's shift settings."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    roles = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }
    tok = byte_level_tokenizer("", ["<|im_start|>", *roles.values()], roles)
    ids = {t: tok.convert_tokens_to_ids(t) for t in roles.values()}
    torch.manual_seed(7)
    text = {
        "vocab_size": len(tok),
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "initializer_range": 0.5,
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": HIDDEN,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        tie_word_embeddings=False,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels, merge_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**pixels, merge_size=2),
    )
    torch.manual_seed(8)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=HIDDEN,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    QwenImageEditPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        processor=processor,
        transformer=transformer,
    ).save_pretrained(path)
    return path
