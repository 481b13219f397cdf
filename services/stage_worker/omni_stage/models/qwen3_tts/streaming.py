"""The speech tokenizer's decoder as a stream: each code decoded once, what the next codes need
carried from one piece to the next.

Every layer of the decoder looks back only: its convolutions are causal (an output reads its
kernel's reach of inputs before it), its transposed convolutions are cut on the right only (an
input frame's overhang is completed by the frames after it), its transformer attends within a
sliding window, and the rest is per position. So what the codes decoded so far leave to the next
ones is small and fixed: each convolution's last (kernel - 1) x dilation inputs, each transposed
convolution's last input frame (whose overhang the next completes), and each attention layer's
keys and values over the window's last positions. A request keeps them (`DecoderStream`) and
decodes each new piece of codes from them: the piece's samples are the whole decode's, within
float rounding, at the cost of the piece alone. Decoding a piece after left context instead
costs the context again at every piece (150 codes for 25: 7x), and is exact only as far as the
context reaches (570 codes for the real decoder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
)


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

    def fresh(self) -> torch.Tensor:
        """A new stream's carry: the zeros a whole decode pads with."""
        w = self.conv.weight
        return w.new_zeros(1, self.conv.in_channels, self.reach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.carry is None:
            return self.conv(F.pad(x, (self.reach, 0)))
        x = torch.cat([self.carry, x], dim=-1)
        self.carry = x[..., x.shape[-1] - self.reach :]
        return self.conv(x)


class CarriedTransConv(nn.Module):
    """A transposed convolution cut on the right only: each input frame's output runs
    (kernel - stride) samples into the next frames', and a decode's last overhang is cut. In a
    stream, its last input frames are carried: the next piece's decode starts from them, and
    their own output, already out, is cut on the left."""

    def __init__(self, causal: Qwen3OmniMoeCausalTransConvNet) -> None:
        super().__init__()
        self.conv = causal.conv
        kernel, stride = int(self.conv.kernel_size[0]), int(self.conv.stride[0])
        if causal.left_pad != 0 or (kernel - stride) % stride:
            raise ValueError("a carried transposed convolution is cut on the right only, by whole frames")
        self.stride, self.frames, self.right = stride, (kernel - stride) // stride, int(causal.right_pad)
        self.reach = self.frames
        self.carry: torch.Tensor | None = None

    def fresh(self) -> torch.Tensor:
        w = self.conv.weight
        return w.new_zeros(1, self.conv.in_channels, self.frames)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cut = 0
        if self.carry is not None:
            x = torch.cat([self.carry, x], dim=-1)
            self.carry = x[..., x.shape[-1] - self.frames :]
            cut = self.frames * self.stride
        y = self.conv(x)
        return y[..., cut : y.shape[-1] - self.right]


Carried = CarriedConv | CarriedTransConv


def carry_through(module: nn.Module) -> list[Carried]:
    """Put carried convolutions in place of `module`'s causal ones (the same weights, the same
    names): the ones whose reach is not nil, in the order a decode runs them."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Qwen3OmniMoeCausalConvNet):
                setattr(parent, name, CarriedConv(child))
            elif isinstance(child, Qwen3OmniMoeCausalTransConvNet):
                setattr(parent, name, CarriedTransConv(child))
    return [m for m in module.modules() if isinstance(m, Carried) and m.reach]


@dataclass(slots=True)
class DecoderStream:
    """One request's place in its decode: what the next codes' decode reads of those before
    (the carried convolutions' inputs, the attention's keys and values), and how many came."""

    carries: list[torch.Tensor]
    past: Any
    """The transformer's `DynamicCache`, its window's last positions."""
    seen: int = 0


def carrying(carried: list[Carried], streams: list[DecoderStream]) -> None:
    """Load the streams' carries into the convolutions, a row each."""
    for i, conv in enumerate(carried):
        conv.carry = torch.cat([s.carries[i] for s in streams])


def carried_away(carried: list[Carried], rows: int) -> list[list[torch.Tensor]]:
    """The convolutions' carries after a decode, a list a row; the convolutions left plain."""
    out: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for conv in carried:
        assert conv.carry is not None
        for row in range(rows):
            out[row].append(conv.carry[row : row + 1])
        conv.carry = None
    return out


def windowed(cache: Any, window: int) -> Any:
    """A `DynamicCache` cut to its last `window - 1` positions: all that the next position's
    sliding window reads."""
    from transformers import DynamicCache

    keep = window - 1
    kept = [(layer.keys[:, :, -keep:], layer.values[:, :, -keep:]) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=kept)
