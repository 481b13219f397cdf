"""Qwen3-TTS's modules, built from transformers' own where the maths is theirs.

transformers has no Qwen3-TTS (the reference is the `qwen-tts` package, pinned to an older
transformers). Its parts are ones transformers does have, with a few layers more:
- the talker's decoder is Qwen3's (q/k norms, SwiGLU): its M-RoPE gets the same position in all
  three sections for speech, which is plain RoPE; it embeds codec ids and text ids by two tables;
- the code predictor is Qwen3-Omni's, with a projection in front where the talker is wider;
- the speech tokenizer's decoder is Qwen3-Omni's Code2Wav, fed by residual codebooks (a
  quantizer's decode and a causal convolution) instead of one embedding table, its transformer
  working at its own width between two projections.
Parameter names are the real checkpoint's, so `load_state_dict(strict=True)` reads it as is."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3Model
from transformers.activations import ACT2FN
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
    Qwen3OmniMoeTalkerCodePredictorConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavTransformerModel,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
    Qwen3OmniMoeTalkerCodePredictorOutputWithPast,
)

from omni_stage.models.qwen3_omni.streaming import Streams, vocoded

DECODER_KEYS = [
    "codebook_size",
    "hidden_size",
    "latent_dim",
    "max_position_embeddings",
    "rope_theta",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "sliding_window",
    "intermediate_size",
    "hidden_act",
    "layer_scale_initial_scale",
    "rms_norm_eps",
    "num_hidden_layers",
    "num_quantizers",
    "upsample_rates",
    "upsampling_ratios",
    "decoder_dim",
    "attention_dropout",
]
"""The speech tokenizer's decoder settings that Qwen3-Omni's Code2Wav config shares."""


def qwen3_config(section: dict[str, Any]) -> Qwen3Config:
    """A transformers Qwen3 config from a talker or code predictor section of config.json."""
    keys = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "attention_bias",
        "attention_dropout",
    ]
    given = {k: section[k] for k in keys if k in section}
    given.setdefault("head_dim", section["hidden_size"] // section["num_attention_heads"])
    theta = section.get("rope_theta", (section.get("rope_scaling") or {}).get("rope_theta", 10000.0))
    return Qwen3Config(**given, rope_parameters={"rope_type": "default", "rope_theta": float(theta)})


class ResizeMLP(nn.Module):
    """The text projection: the text table's width to the talker's, through an MLP."""

    def __init__(self, width_in: int, hidden: int, width_out: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width_in, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, width_out, bias=True)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class TalkerModel(Qwen3Model):
    """Qwen3's decoder with the talker's two tables in place of one."""

    def __init__(self, config: Qwen3Config, text_vocab: int, text_width: int) -> None:
        super().__init__(config)
        del self.embed_tokens
        self.codec_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.text_embedding = nn.Embedding(text_vocab, text_width)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.codec_embedding


class CodePredictor(Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration):
    """Qwen3-Omni's code predictor; its code tables are as wide as the talker, and a talker wider
    than it is projected down first (`small_to_mtp_projection`, the 1.7B models')."""

    def __init__(self, config: Qwen3OmniMoeTalkerCodePredictorConfig, talker_width: int) -> None:
        super().__init__(config)
        groups = config.num_code_groups - 1
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, talker_width) for _ in range(groups)
        )
        wider = talker_width != config.hidden_size
        self.small_to_mtp_projection = (
            nn.Linear(talker_width, config.hidden_size, bias=True) if wider else nn.Identity()
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        generation_steps: int | None = None,
        **kw: Any,
    ) -> Qwen3OmniMoeTalkerCodePredictorOutputWithPast:
        """As Qwen3-Omni's: the frame's prompt (the talker's hidden state and code 0's row), or a
        sub-step's code by the table of its group; projected first."""
        if inputs_embeds is not None and inputs_embeds.shape[1] > 1:
            generation_steps = inputs_embeds.shape[1] - 2
        else:
            assert input_ids is not None and generation_steps is not None
            inputs_embeds = self.model.get_input_embeddings()[generation_steps - 1](input_ids)
        out = self.model(inputs_embeds=self.small_to_mtp_projection(inputs_embeds), **kw)
        return Qwen3OmniMoeTalkerCodePredictorOutputWithPast(
            logits=self.lm_head[generation_steps](out.last_hidden_state),
            past_key_values=out.past_key_values,
            generation_steps=generation_steps + 1,
        )


class Talker(nn.Module):
    """The talker (`talker.` in the checkpoint): decoder, text projection, codec head, code
    predictor. The calls the Qwen3 talker's code (code_predictor.py) makes of a loaded talker."""

    def __init__(self, section: dict[str, Any]) -> None:
        super().__init__()
        config = qwen3_config(section)
        self.config = config
        self.model = TalkerModel(config, section["text_vocab_size"], section["text_hidden_size"])
        width = config.hidden_size
        text = section["text_hidden_size"]
        self.text_projection = ResizeMLP(text, text, width, section.get("hidden_act", "silu"))
        self.codec_head = nn.Linear(width, config.vocab_size, bias=False)
        predictor = dict(section["code_predictor_config"])
        cp = qwen3_config(predictor).to_dict()
        cp.update(num_code_groups=predictor["num_code_groups"], layer_types=None, use_sliding_window=False)
        self.code_predictor = CodePredictor(Qwen3OmniMoeTalkerCodePredictorConfig(**cp), width)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.codec_embedding

    def text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text ids, embedded and projected to the talker's width."""
        return self.text_projection(self.model.text_embedding(ids))


class Codebooks(nn.Module):
    """One residual group of codebooks: each code's vector (the running sum over its uses divided
    by its count, as the quantizer keeps them), summed over the group, projected."""

    def __init__(self, n: int, bins: int, dim: int, width: int) -> None:
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(_Codebook(bins, dim) for _ in range(n))
        self.input_proj = nn.Conv1d(width, dim, 1, bias=False)  # the encoder's side: kept, unused
        self.output_proj = nn.Conv1d(dim, width, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, n, T] -> [B, width, T]."""
        summed = sum(layer.decode(codes[:, i]) for i, layer in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))


class _Codebook(nn.Module):
    def __init__(self, bins: int, dim: int) -> None:
        super().__init__()
        self._codebook = nn.Module()
        self._codebook.cluster_usage = nn.Parameter(torch.ones(bins))
        self._codebook.embedding_sum = nn.Parameter(torch.zeros(bins, dim))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        book = self._codebook
        table = book.embedding_sum / book.cluster_usage.clamp(min=1e-5)[:, None]
        return nn.functional.embedding(codes, table)


class Quantizer(nn.Module):
    """The first (semantic) codebook and the rest, each group projected to the decoder's input."""

    def __init__(self, groups: int, bins: int, width: int) -> None:
        super().__init__()
        self.rvq_first = Codebooks(1, bins, width // 2, width)
        self.rvq_rest = Codebooks(groups - 1, bins, width // 2, width)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


class PreTransformer(Qwen3OmniMoeCode2WavTransformerModel):
    """Code2Wav's transformer between projections from and back to the decoder's latent width."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig, latent: int) -> None:
        super().__init__(config)
        self.input_proj = nn.Linear(latent, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, latent)

    def forward(self, inputs_embeds: torch.Tensor, **kw: Any) -> Any:
        out = super().forward(inputs_embeds=self.input_proj(inputs_embeds), **kw)
        out.last_hidden_state = self.output_proj(out.last_hidden_state)
        return out


class SpeechDecoder(Qwen3OmniMoeCode2Wav):
    """The speech tokenizer's decoder (`decoder.` in speech_tokenizer/): codes [B, groups, T] to a
    waveform [B, 1, T * total_upsample] in [-1, 1], causal, as Code2Wav; decoded whole, or as
    streams, piece by piece (`streams`: qwen3_omni/streaming.py)."""

    def __init__(self, section: dict[str, Any]) -> None:
        latent = int(section["latent_dim"])
        config = Qwen3OmniMoeCode2WavConfig(**{k: section[k] for k in DECODER_KEYS if k in section})
        super().__init__(config)
        del self.code_embedding
        self.pre_transformer = PreTransformer(config, latent)
        self.quantizer = Quantizer(config.num_quantizers, config.codebook_size, int(section["codebook_dim"]))
        self.pre_conv = Qwen3OmniMoeCausalConvNet(int(section["codebook_dim"]), latent, 3)
        if latent != config.hidden_size:  # the upsampling runs at the latent width
            self.upsample = nn.ModuleList(
                nn.ModuleList(
                    [Qwen3OmniMoeCausalTransConvNet(latent, latent, f, f), Qwen3OmniMoeConvNeXtBlock(latent)]
                )
                for f in config.upsampling_ratios
            )
            self.decoder[0] = Qwen3OmniMoeCausalConvNet(latent, config.decoder_dim, 7)
        for conv in self.modules():  # causal: what the kernel adds past the input is cut on the right only
            if isinstance(conv, Qwen3OmniMoeCausalTransConvNet):
                conv.left_pad = 0
        self.streams = Streams(self, self.pre_transformer, self._embedded, self._vocoded)
        self.total_upsample = math.prod(config.upsample_rates + config.upsampling_ratios)

    def forward(self, codes: torch.Tensor, **kw: Any) -> torch.Tensor:
        return self._vocoded(self.pre_transformer(inputs_embeds=self._embedded(codes)).last_hidden_state)

    def _embedded(self, codes: torch.Tensor) -> torch.Tensor:
        return self.pre_conv(self.quantizer.decode(codes)).transpose(1, 2)

    def _vocoded(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocoded(self, hidden)
