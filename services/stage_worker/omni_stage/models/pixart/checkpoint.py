"""tiny-image: a PixArt-Alpha text-to-image pipeline directory with tiny dimensions and random
weights (the transformer, the VAE, the scheduler), as diffusers' `PixArtAlphaPipeline` loads
it. Its text encoder is the pipeline's upstream text stage, whose hidden states condition it."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch

from omni_stage.demo import HIDDEN

CAPTION_CHANNELS: Final = HIDDEN
"""The width of the text stage's states it reads: the demo thinker's hidden size."""


def write_tiny_checkpoint(path: Path) -> Path:
    """A diffusers pipeline directory: model_index.json naming each part, each part saved by
    its own save_pretrained. The text encoder is the separate text stage, so it has none."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtTransformer2DModel,
    )

    torch.manual_seed(3)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,  # PixArt learns the variance too; the sampler drops that half
        num_layers=2,
        cross_attention_dim=32,
        caption_channels=CAPTION_CHANNELS,
        sample_size=16,
        patch_size=2,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )
    PixArtAlphaPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    ).save_pretrained(path)
    return path
