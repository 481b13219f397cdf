"""tiny-qwen3-tts-*: Qwen3-TTS checkpoints with tiny dimensions and random weights, laid out as the
real ones are (Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice and its siblings).

The files a real checkpoint holds: config.json (`model_type: qwen3_tts`, `tts_model_type`, the
talker's section with its code predictor's, the speaker encoder's, the TTS and chat token ids),
generation_config.json (the reference's sampling defaults), model.safetensors (`talker.*`, and a
Base model's `speaker_encoder.*`), a
Qwen2 tokenizer whose special tokens (`<|im_start|>`, `<|im_end|>`, `<|tts_pad|>`, `<|tts_bos|>`,
`<|tts_eos|>`) are ids inside its vocabulary and whose `assistant` is one token, as in Qwen's, and
speech_tokenizer/ (the Qwen3-TTS-Tokenizer-12Hz: its config, the Mimi feature extractor's
settings, and `encoder.*` (Mimi's) and `decoder.*` weights). `qwen-tts` loads them with its own
`from_pretrained` (scripts/qwen_tts_reference.py).

Real where it matters to a consumer: the codec vocabulary (3072, codes below 2048, control ids
above at their real values), 16 code groups, the 12.5 Hz codes and 24 kHz audio (1920 samples a
code). Tiny: widths 32-64, two layers each; the code predictor narrower than the talker (the
1.7B models' projection between them). Speaker and language ids are in the codec's control
range; the ones published are the real ids.

The released sizes (`QWEN3_TTS_RELEASES`, `omni models init-config-only`) without their
weights, served with `loadFormat: dummy`: the 0.6B talker is Qwen3-0.6B's decoder and the 1.7B's is
Qwen3-1.7B's (28 layers, 16 heads over 8 key-value heads of 128, MLP 3x the width); the code
predictor is five such layers at 1024 in both; the speech tokenizer is one for every size
(its decoder 8 layers at 512 between 1024-wide latents and a 1536-channel upsampler, its
encoder Mimi's own sizes). Written down from what public ports of the model document, checked
by the released weights' sizes as they publish them (a 0.6B Base holds 0.91 billion
parameters, 1.83 GB in bf16), not from the released config.json files, which cannot be
fetched here: check them against those where a checkpoint is at hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_stage.demo_tokenizer import byte_level_tokenizer
from omni_stage.models.qwen3_omni.checkpoint import FULL_SIZE as QWEN3_OMNI_FULL_SIZE
from omni_stage.models.qwen3_tts.cloning import SpeakerEncoder
from omni_stage.models.qwen3_tts.modeling import SpeechDecoder, Talker
from omni_stage.models.qwen_omni.checkpoint import keep_the_waveform
from omni_stage.models.releases import QWEN3_TTS_RELEASES

VARIANTS: Final = ("custom_voice", "voice_design", "base")
"""The `tts_model_type`s: named speakers, voices described, voices cloned (its speaker encoder)."""
CODEC_VOCAB: Final = 3072
GROUPS: Final = 16
CODEC_IDS: Final = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
LANGUAGES: Final = {"english": 2050, "chinese": 2055, "french": 2061, "beijing_dialect": 2074}
SPEAKERS: Final = {"aiden": 2861, "ryan": 3061, "vivian": 3065, "serena": 3066, "dylan": 2878}
DIALECTS: Final = {"dylan": "beijing_dialect"}
SPECIAL_TOKENS: Final = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
]
TALKER: Final = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "rope_scaling": {"interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
    "text_hidden_size": 48,
    "vocab_size": CODEC_VOCAB,
    "num_code_groups": GROUPS,
    "position_id_per_seconds": 13,
}
CODE_PREDICTOR: Final = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "vocab_size": 2048,
    "num_code_groups": GROUPS,
}
DECODER: Final = {
    "codebook_size": 2048,
    "codebook_dim": 16,
    "hidden_size": 32,
    "latent_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,  # as the real one's: wider than its width over its heads
    "sliding_window": 72,
    "max_position_embeddings": 8000,
    "rope_theta": 10000,
    "layer_scale_initial_scale": 0.01,
    "rms_norm_eps": 1e-5,
    "num_quantizers": GROUPS,
    "upsample_rates": [8, 5, 4, 3],
    "upsampling_ratios": [2, 2],
    "decoder_dim": 32,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
}
ENCODER: Final = {  # Mimi, as the real tokenizer's encoder, at tiny widths
    "hidden_size": 32,
    "num_filters": 4,
    "num_residual_layers": 1,
    "upsampling_ratios": [8, 6, 5, 4],
    "kernel_size": 7,
    "last_kernel_size": 3,
    "residual_kernel_size": 3,
    "dilation_growth_rate": 2,
    "codebook_size": 2048,
    "codebook_dim": 16,
    "vector_quantization_hidden_dimension": 16,
    "num_quantizers": 32,
    "num_semantic_quantizers": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "sliding_window": 250,
    "sampling_rate": 24000,
    "frame_rate": 12.5,
    "use_streaming": False,
    "upsample_groups": 32,
}
SPEAKER_ENCODER: Final = {  # the real one's layout (ECAPA-TDNN), at tiny widths
    "mel_dim": 128,
    "enc_dim": TALKER["hidden_size"],
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 16,
    "enc_res2net_scale": 4,
    "enc_se_channels": 16,
    "sample_rate": 24000,
}


@dataclass(frozen=True, slots=True)
class Sizes:
    """A checkpoint's dimensions: its talker's and code predictor's sections, its speech
    tokenizer's decoder and encoder, its speaker encoder's (a Base model's), its size's name
    (`tts_model_size`: the reference takes no style instruction at 0b6), and its text
    vocabulary (None: the tokenizer's own)."""

    talker: dict[str, Any]
    code_predictor: dict[str, Any]
    decoder: dict[str, Any]
    encoder: dict[str, Any]
    speaker_encoder: dict[str, Any]
    size: str
    text_vocab: int | None = None


TINY: Final = Sizes(TALKER, CODE_PREDICTOR, DECODER, ENCODER, SPEAKER_ENCODER, "1b7")
_FULL_TALKER: Final = TALKER | {  # Qwen3-0.6B's and Qwen3-1.7B's decoder layers (their widths below)
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_scaling": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "text_hidden_size": 2048,
}
_FULL_CODE_PREDICTOR: Final = CODE_PREDICTOR | {  # Qwen3-Omni's, at its size (modeling.CodePredictor)
    k: v for k, v in QWEN3_OMNI_FULL_SIZE.code_predictor.items() if k != "max_position_embeddings"
}
_FULL_DECODER: Final = DECODER | {
    "codebook_dim": 512,
    "hidden_size": 512,
    "latent_dim": 1024,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "decoder_dim": 1536,
}
_FULL_ENCODER: Final = {  # Mimi's own sizes
    **ENCODER,
    "hidden_size": 512,
    "num_filters": 64,
    "codebook_dim": 256,
    "vector_quantization_hidden_dimension": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2048,
    "upsample_groups": 512,
}
_FULL_SPEAKER: Final = SPEAKER_ENCODER | {
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}
QWEN_VOCAB: Final = 151936


def _full(width: int, mlp: int, size: str) -> Sizes:
    return Sizes(
        _FULL_TALKER | {"hidden_size": width, "intermediate_size": mlp},
        _FULL_CODE_PREDICTOR,
        _FULL_DECODER,
        _FULL_ENCODER,
        _FULL_SPEAKER | {"enc_dim": width},
        size,
        QWEN_VOCAB,
    )


FULL_SIZES: Final = {"1.7b": _full(2048, 6144, "1b7"), "0.6b": _full(1024, 3072, "0b6")}
ATTENTIVE: Final = 0.3
"""The talker's layers' weights are drawn this wide: at transformers' 0.02 a position's output is
nearly its own input, and a style instruction at the prompt's start would change no code."""
GENERATION: Final = {  # the reference's defaults (its generate_config.json)
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9,
    "max_new_tokens": 8192,
}


QWEN_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer pattern: a newline is never merged into the word after it, which the
reference's prompt slicing counts on (`<|im_start|>`, `assistant`, newline: three ids)."""


def tokenizer() -> Any:
    """Printable characters and their pairs, the specials after them; `assistant` one token;
    split into words as Qwen2's tokenizer splits."""
    from tokenizers import Regex, pre_tokenizers

    tok = byte_level_tokenizer("", SPECIAL_TOKENS, ordinary=512)
    tok.add_tokens(["assistant"])
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return tok


def config(variant: str, tok: Any, sizes: Sizes = TINY) -> dict[str, Any]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} | {
        "assistant": tok.convert_tokens_to_ids("assistant")
    }
    speakers = SPEAKERS if variant == "custom_voice" else {}
    talker = {
        **sizes.talker,
        **CODEC_IDS,
        "model_type": "qwen3_tts_talker",
        "text_vocab_size": sizes.text_vocab or len(tok),
        "codec_language_id": LANGUAGES,
        "spk_id": speakers,
        "spk_is_dialect": {s: DIALECTS.get(s, False) for s in speakers},
        "code_predictor_config": {**sizes.code_predictor, "model_type": "qwen3_tts_talker_code_predictor"},
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": sizes.size,
        "tts_model_type": variant,
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"],
        "tts_bos_token_id": ids["<|tts_bos|>"],
        "tts_eos_token_id": ids["<|tts_eos|>"],
        "assistant_token_id": ids["assistant"],
        "talker_config": talker,
        "speaker_encoder_config": sizes.speaker_encoder,
    }


def write_speech_tokenizer_config(path: Path, sizes: Sizes = TINY) -> None:
    """speech_tokenizer/'s config and feature extractor settings: the 12 Hz tokenizer's."""
    from transformers import EncodecFeatureExtractor

    path.mkdir(parents=True, exist_ok=True)
    settings = {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_config": {**sizes.encoder, "model_type": "mimi"},
        "decoder_config": sizes.decoder,
        "encoder_valid_num_quantizers": GROUPS,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
    }
    (path / "config.json").write_text(json.dumps(settings, indent=2))
    features = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0)
    features.save_pretrained(path)


def write_speech_tokenizer(path: Path) -> None:
    """speech_tokenizer/: the tiny 12 Hz tokenizer's config, feature extractor settings and weights."""
    from safetensors.torch import save_file
    from transformers import MimiConfig, MimiModel

    write_speech_tokenizer_config(path)
    decoder = SpeechDecoder(DECODER).eval()
    keep_the_waveform(decoder)
    with torch.no_grad():  # codebooks as a trained quantizer keeps them: counts and sums
        for p in decoder.quantizer.parameters():
            if p.ndim == 2 and p.shape[0] == DECODER["codebook_size"]:
                p.normal_(0, 1)
    encoder = MimiModel(MimiConfig(**ENCODER)).eval()
    with torch.no_grad():  # Mimi's codebooks start at zero: a clip would encode to codes 0 alone
        for name, buffer in encoder.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_(0, 1)
    unused = ("upsample.", "decoder")  # Mimi's decoding half, which the tokenizer drops
    weights = {f"encoder.{k}": v for k, v in encoder.state_dict().items() if not k.startswith(unused)}
    weights |= {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors")


def _write_files(path: Path, variant: str, sizes: Sizes) -> tuple[Any, dict[str, Any]]:
    """Everything but the weights: config.json, generation_config.json, the tokenizer's files
    and speech_tokenizer/'s settings; the tokenizer and the config."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen3-TTS variant {variant!r}: one of {', '.join(VARIANTS)}")
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    settings = config(variant, tok, sizes)
    (path / "config.json").write_text(json.dumps(settings, indent=2))
    (path / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    tok.save_pretrained(path)
    _name_the_tokenizer_class(path)
    write_speech_tokenizer_config(path / "speech_tokenizer", sizes)
    return tok, settings


def write_config_only(
    path: Path, release: str = "qwen3-tts-1.7b-customvoice", sizes: Sizes | None = None
) -> Path:
    """Write `release` (one of QWEN3_TTS_RELEASES) without its weights into `path` (a directory;
    returns it): its config at its sizes (or at `sizes`), the demo's tokenizer at the real text
    vocabulary's width, the speech tokenizer's settings. Its stages serve with `loadFormat:
    dummy` (random weights built on the device); its speech is noise."""
    if release not in QWEN3_TTS_RELEASES:
        raise ValueError(f"unknown Qwen3-TTS release {release!r}: one of {', '.join(QWEN3_TTS_RELEASES)}")
    size, variant = QWEN3_TTS_RELEASES[release]
    _write_files(path, variant, sizes or FULL_SIZES[size])
    return path


def write_random(
    path: Path,
    release: str = "qwen3-tts-1.7b-customvoice",
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    sizes: Sizes | None = None,
) -> Path:
    """`write_config_only`'s checkpoint with its weights, laid out as the release's files are
    (`omni models init-random`): model.safetensors (`talker.`; a Base model's `speaker_encoder.`
    too) and speech_tokenizer/model.safetensors (`decoder.`; a Base model's `encoder.` too),
    each module built as `loadFormat: dummy` builds it (loading.py), so that each stage reads
    with `auto` the very weights it builds with `dummy`. The speech tokenizer in float32, as it
    is loaded."""
    from safetensors.torch import save_file

    from omni_stage.checkpoint_files import readable_as_other_files
    from omni_stage.models.qwen3_tts import loading

    write_config_only(path, release, sizes)
    on = torch.device(device)
    model: dict[str, torch.nn.Module] = {"talker.": loading.load_talker(path, on, dtype, dummy=True)}
    speech: dict[str, torch.nn.Module] = {"decoder.": loading.load_decoder(path, on, dummy=True)}
    if QWEN3_TTS_RELEASES[release][1] == "base":
        cloner = loading.load_cloner(path, on, dtype, dummy=True)
        model["speaker_encoder."], speech["encoder."] = cloner.speaker, cloner.speech
    for file, modules in (
        (path / "model.safetensors", model),
        (path / "speech_tokenizer" / "model.safetensors", speech),
    ):
        tensors = {p + k: v.contiguous().cpu() for p, m in modules.items() for k, v in m.state_dict().items()}
        save_file(tensors, file, metadata={"format": "pt"})
    readable_as_other_files(path)
    return path


def write_checkpoint(path: Path, variant: str = "custom_voice", seed: int = 0) -> Path:
    """A tiny Qwen3-TTS checkpoint of `variant` at `path`."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    _, settings = _write_files(path, variant, TINY)
    talker = Talker(settings["talker_config"]).eval()
    with torch.no_grad():  # wider than the init's 0.02, so that every row of the prompt counts
        for name, p in talker.named_parameters():
            if name.endswith("embedding.weight") or ".codec_embedding." in name:
                p.normal_(0, 1)
            elif name.startswith("model.layers.") and p.ndim == 2:
                p.normal_(0, ATTENTIVE)
    state = {f"talker.{k}": v.contiguous() for k, v in talker.state_dict().items()}
    if variant == "base":
        speaker = SpeakerEncoder(SPEAKER_ENCODER).eval()
        state |= {f"speaker_encoder.{k}": v.contiguous() for k, v in speaker.state_dict().items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    write_speech_tokenizer(path / "speech_tokenizer")
    return path


def write_tiny_checkpoint(path: Path) -> Path:
    """The demo's (`omni models init-demo`): the CustomVoice variant at `path`, the VoiceDesign
    and Base ones beside it (`<path>-voice-design`, `<path>-base`)."""
    write_checkpoint(path.with_name(f"{path.name}-voice-design"), "voice_design", seed=1)
    write_checkpoint(path.with_name(f"{path.name}-base"), "base", seed=2)
    return write_checkpoint(path, "custom_voice")


def _name_the_tokenizer_class(path: Path) -> None:
    """tokenizer_config.json as Qwen's are written: the processor asks for a Qwen2 tokenizer by
    name (the same tokenizer.json, named so), and the special tokens' list under the key
    transformers 4 reads (5 reads both)."""
    file = path / "tokenizer_config.json"
    settings = json.loads(file.read_text())
    settings["tokenizer_class"] = "Qwen2TokenizerFast"
    if isinstance(settings.get("extra_special_tokens"), list):
        settings["additional_special_tokens"] = settings.pop("extra_special_tokens")
    file.write_text(json.dumps(settings, indent=2))
