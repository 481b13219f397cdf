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
from pathlib import Path
from typing import Final

import torch
from safetensors.torch import load_file, save_file

from omni_stage.demo_tokenizer import byte_level_tokenizer
from omni_stage.engines.base import import_object
from omni_stage.engines.registry import FAMILIES

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


def _image_pipeline(path: Path, caption_channels: int) -> None:
    """A diffusers pipeline directory: model_index.json naming each part, each part saved by
    its own save_pretrained. The text encoder is the separate text stage, so it has none."""
    import diffusers
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel

    torch.manual_seed(3)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,  # PixArt learns the variance too; the sampler drops that half
        num_layers=2,
        cross_attention_dim=32,
        caption_channels=caption_channels,
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
    transformer.save_pretrained(path / "transformer")
    vae.save_pretrained(path / "vae")
    DPMSolverMultistepScheduler().save_pretrained(path / "scheduler")
    index = {
        "_class_name": "PixArtAlphaPipeline",
        "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": [None, None],
        "tokenizer": [None, None],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def _video_pipeline(path: Path) -> None:
    """A Wan 2.1 text-to-video pipeline directory as diffusers' `WanPipeline` loads it: a UMT5
    text encoder (with the demo tokenizer), the 3D transformer, the causal 3D VAE (4x in time,
    8x in space) and the flow-matching UniPC scheduler Wan ships with."""
    import diffusers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = byte_level_tokenizer("", [])
    torch.manual_seed(5)
    UMT5EncoderModel(
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
    ).save_pretrained(path / "text_encoder")
    tok.save_pretrained(path / "tokenizer")
    WanTransformer3DModel(
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
    ).save_pretrained(path / "transformer")
    AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).save_pretrained(path / "vae")
    UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def _edit_pipeline(path: Path) -> None:
    """A Qwen-Image-Edit pipeline directory as diffusers' `QwenImageEditPipeline` loads it: the
    Qwen2.5-VL model that reads the instruction with the image (the demo tokenizer with
    Qwen's vision tokens; its processor reads at most 112x112 pixels), the Qwen-Image MMDiT,
    the Qwen-Image VAE (8x in space) and the scheduler with Qwen-Image's shift settings."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
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
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path / "text_encoder")
    tok.save_pretrained(path / "tokenizer")
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2}
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels, merge_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**pixels, merge_size=2),
    ).save_pretrained(path / "processor")
    torch.manual_seed(8)
    QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=HIDDEN,
        axes_dims_rope=(4, 6, 6),
    ).save_pretrained(path / "transformer")
    AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).save_pretrained(path / "vae")
    FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "QwenImageEditPipeline",
        "_diffusers_version": diffusers.__version__,
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "processor": ["transformers", "Qwen2VLProcessor"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def init_demo(out_dir: str | Path) -> dict[str, Path]:
    """Write tiny-thinker, tiny-talker, tiny-vocoder, each model family's tiny checkpoint
    (tiny-qwen2.5-omni, tiny-qwen3-omni: the registry's FAMILIES) and tiny-image (last: its index
    means all are there) under `out_dir`; returns their paths, by name without `tiny-`."""
    out = Path(out_dir)
    families = (f.demo for f in FAMILIES.values())
    names = ("thinker", "talker", "vocoder", *families, "video", "image-edit", "image")
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

    for family in FAMILIES.values():
        import_object(family.checkpoint)(paths[family.demo])
    _video_pipeline(paths["video"])
    _edit_pipeline(paths["image-edit"])
    _image_pipeline(paths["image"], caption_channels=HIDDEN)
    return paths
