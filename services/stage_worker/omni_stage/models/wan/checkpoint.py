"""tiny-video: a Wan 2.1 text-to-video pipeline directory with tiny dimensions and random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_stage.demo_tokenizer import byte_level_tokenizer


def write_tiny_checkpoint(path: Path) -> Path:
    """A Wan 2.1 text-to-video pipeline directory as diffusers' `WanPipeline` loads it: a UMT5
    text encoder (with the demo tokenizer), the 3D transformer, the causal 3D VAE (4x in time,
    8x in space) and the flow-matching UniPC scheduler Wan ships with."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = byte_level_tokenizer("", [])
    torch.manual_seed(5)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    WanPipeline(
        tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    ).save_pretrained(path)
    return path
