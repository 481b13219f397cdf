"""Qwen3's code2wav decoders (Qwen3-Omni's Code2Wav, Qwen3-TTS's speech tokenizer decoder) as
streams: each code decoded once, what the next codes need carried from one piece to the next.

Every layer of these decoders looks back only: the convolutions are causal (an output reads its
kernel's reach of inputs before it), each transposed convolution's overhang past an input frame
is completed by the frames after it, the transformer attends within a sliding window, and the
rest is per position. So what the codes decoded so far leave to the next ones is small and
fixed: each convolution's last (kernel - 1) x dilation inputs, each transposed convolution's
last input frame, and each attention layer's keys and values over the window's last
positions. A request keeps them (`DecoderStream`) and decodes each new piece of codes from
them, the piece's samples being those of the whole decode that are final (within float
rounding), at the cost of the piece alone. A transposed convolution's outputs that the next
frame still adds to are not final: Qwen3-TTS's decoder cuts them (on the right only), so a
piece of n codes gives n x 1920 samples; Qwen3-Omni's cuts as many on the left too, so its
decode of n codes gives 555 samples fewer (480 + 60 + 12 + 3 over its four upsamplings), which
the next piece gives. Decoding a piece after left context instead costs the context again at
every piece (150 codes for 25: 7x), and is exact only as far as the context reaches (570 codes
for the real decoders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
)

from omni_stage.engines.kv_batch import decode_together


class CarriedConv(nn.Module):
    """A causal convolution (stride 1): zeros before the first input in a whole decode; in a
    stream, the inputs its kernel reaches back to come from the carry, which it leaves holding its
    own last inputs. The weights stay the original's (`conv`), under the same names."""

    def __init__(self, causal: Qwen3OmniMoeCausalConvNet) -> None:
        super().__init__()
        if causal.stride != 1:
            raise ValueError("a carried convolution has stride 1")
        self.conv = causal.conv
        self.reach = int(causal.padding)  # (kernel - 1) x dilation
        self.carry: torch.Tensor | None = None
        self.fresh = False

    def start(self) -> torch.Tensor:
        """A new stream's carry: the zeros a whole decode pads with."""
        return self.conv.weight.new_zeros(1, self.conv.in_channels, self.reach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.carry is None:
            return self.conv(F.pad(x, (self.reach, 0)))
        x = torch.cat([self.carry, x], dim=-1)
        self.carry = x[..., x.shape[-1] - self.reach :]
        return self.conv(x)


class CarriedTransConv(nn.Module):
    """A transposed convolution whose decode cuts `left` outputs at its start and, at its end,
    the overhang its last frame leaves (kernel - stride outputs, not final until the next frame
    comes). In a stream, its last input frames are carried: a piece's decode starts from them,
    and their own outputs, already out, are cut on the left (and `left` more at the stream's
    start)."""

    def __init__(self, causal: Qwen3OmniMoeCausalTransConvNet) -> None:
        super().__init__()
        self.conv = causal.conv
        kernel, stride = int(self.conv.kernel_size[0]), int(self.conv.stride[0])
        if causal.right_pad != kernel - stride or (kernel - stride) % stride:
            raise ValueError("a carried transposed convolution cuts its last overhang, whole frames of it")
        self.stride, self.left, self.right = stride, int(causal.left_pad), int(causal.right_pad)
        self.reach = (kernel - stride) // stride  # input frames carried
        self.carry: torch.Tensor | None = None
        self.fresh = False
        """In a stream, whether this piece is the stream's first (its `left` outputs are cut)."""

    def start(self) -> torch.Tensor:
        return self.conv.weight.new_zeros(1, self.conv.in_channels, self.reach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cut = self.left
        if self.carry is not None:
            x = torch.cat([self.carry, x], dim=-1)
            self.carry = x[..., x.shape[-1] - self.reach :]
            cut = self.reach * self.stride + (self.left if self.fresh else 0)
        y = self.conv(x)
        return y[..., cut : y.shape[-1] - self.right]


Carried = CarriedConv | CarriedTransConv


def carry_through(module: nn.Module) -> list[Carried]:
    """Put carried convolutions in place of `module`'s causal ones (the same weights, the same
    names; a whole decode computes as before): the ones that carry something, in the order a
    decode runs them."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Qwen3OmniMoeCausalConvNet):
                setattr(parent, name, CarriedConv(child))
            elif isinstance(child, Qwen3OmniMoeCausalTransConvNet):
                setattr(parent, name, CarriedTransConv(child))
    return [m for m in module.modules() if isinstance(m, Carried) and (m.reach or getattr(m, "left", 0))]


@dataclass(slots=True)
class DecoderStream:
    """One request's place in its decode: what the next codes' decode reads of those before
    (the carried convolutions' inputs, the attention's keys and values), and how many came."""

    carries: list[torch.Tensor]
    past: Any
    """The transformer's `DynamicCache`, its window's last positions."""
    seen: int = 0


class Streams:
    """A Qwen3 code2wav decoder's streams: `embed` (codes [B, groups, n] to the transformer's
    input [B, n, width]), its sliding-window `transformer`, then `vocode` (its output to the
    waveform [B, 1, samples]), with the decoder's convolutions carried (`carry_through`)."""

    def __init__(
        self,
        decoder: nn.Module,
        transformer: nn.Module,
        embed: Callable[[torch.Tensor], torch.Tensor],
        vocode: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.carried = carry_through(decoder)
        self.transformer, self.embed, self.vocode = transformer, embed, vocode
        self.config = transformer.config

    def start(self) -> DecoderStream:
        """A request's stream before its first code."""
        from transformers import DynamicCache

        c = self.config
        head = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)  # as its attention reads it
        w = next(self.transformer.parameters())
        empty = w.new_zeros(1, c.num_key_value_heads, 0, head)
        past = DynamicCache(ddp_cache_data=[(empty, empty)] * c.num_hidden_layers)
        return DecoderStream([conv.start() for conv in self.carried], past)

    def decode(self, codes: torch.Tensor, streams: list[DecoderStream]) -> torch.Tensor:
        """The next codes [B, groups, n] of B streams (the same n, and all or none at their
        start), decoded from where each stream is: their final samples [B, 1, samples]; each
        stream moved past them (untouched if the decode fails)."""
        n = codes.shape[-1]
        fresh = {s.seen == 0 for s in streams}
        if len(fresh) != 1:
            raise ValueError("streams at their start decode apart from those under way")
        positions = [torch.arange(s.seen, s.seen + n, device=codes.device)[None] for s in streams]
        for i, conv in enumerate(self.carried):
            conv.carry = torch.cat([s.carries[i] for s in streams])
            conv.fresh = fresh == {True}
        try:
            out, pasts = decode_together(
                self.transformer, [s.past for s in streams], positions, inputs_embeds=self.embed(codes)
            )
            wav = self.vocode(out.last_hidden_state)
            carries = [[_row(conv.carry, row) for conv in self.carried] for row in range(len(streams))]
        finally:
            for conv in self.carried:
                conv.carry = None
        for s, carry, past in zip(streams, carries, pasts, strict=True):
            s.carries, s.past, s.seen = carry, _windowed(past, self.config.sliding_window), s.seen + n
        return wav


def vocoded(decoder: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A Qwen3 code2wav decoder's upsampling and vocoder on its transformer's output [B, n,
    width]: the waveform [B, 1, samples] in [-1, 1] (as transformers' Code2Wav's forward)."""
    hidden = hidden.permute(0, 2, 1)
    for blocks in decoder.upsample:
        for block in blocks:
            hidden = block(hidden)
    wav = hidden
    for block in decoder.decoder:
        wav = block(wav)
    return wav.clamp(min=-1, max=1)


def _row(carry: torch.Tensor | None, row: int) -> torch.Tensor:
    """A row of what a carried convolution left after a batch's decode, copied: a view would
    keep the whole batch's activations of the piece."""
    assert carry is not None
    return carry[row : row + 1].clone()


def _windowed(cache: Any, window: int) -> Any:
    """A `DynamicCache` cut to its last `window - 1` positions: all that the next position's
    sliding window reads (copies, which hold no more than that)."""
    from transformers import DynamicCache

    keep = window - 1
    kept = [(layer.keys[:, :, -keep:].clone(), layer.values[:, :, -keep:].clone()) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=kept)
