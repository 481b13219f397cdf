"""Qwen2.5-Omni token2wav's DiT, run layer by layer with what does not change computed once.

transformers' `Qwen2_5OmniToken2WavDiTModel.sample` calls the whole DiT at each of the 36
evaluations of its Runge-Kutta solve, and each call encodes the voice's reference mel with the
speaker encoder and embeds the codes again: the same results every time (on the tiny checkpoint
the speaker encoder alone was 40% of a chunk's time). Here the DiT's own modules run in the
reference's order, with those computed once per decode.

And a streamed request keeps, from one chunk to the next, all that its next chunk's attention
reads of the frames before it: the input of each look-back layer over the last block, at each
evaluation (`LeftContext`). A chunk then solves only its own frames and its right context,
instead of solving its left context's frames again at every chunk as a window of context does.
Those kept frames were solved before the chunk after them was known beyond the right context,
so a chunk is close to the whole decode, not equal to it (tests/unit/test_qwen_omni.py says how
close, against the windows of context that vLLM-Omni decodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

STEPS: Final = 10
"""`sample`'s defaults: 10 time points (9 Runge-Kutta steps of 4 evaluations), guidance 0.5,
sway -1."""
GUIDANCE: Final = 0.5
SWAY: Final = -1.0


@dataclass(frozen=True, slots=True)
class LeftContext:
    """What a chunk's look-back layers read of the frames before it: for each evaluation of the
    solve, each look-back layer's input over those frames, the guided and the null row
    ([2, frames, hidden])."""

    inputs: tuple[dict[int, torch.Tensor], ...]

    @property
    def frames(self) -> int:
        return next(iter(self.inputs[0].values())).shape[1] if self.inputs and self.inputs[0] else 0


@dataclass(frozen=True, slots=True)
class Window:
    """One request's frames to solve in a batch: its codes, starting noise and conditioning,
    where they start in the request, and what was kept of the frames before them."""

    codes: torch.Tensor
    noise: torch.Tensor
    cond: torch.Tensor
    ref: torch.Tensor
    start: int
    """The first frame's index in the request (the positions the DiT's rotary embedding reads)."""
    left: LeftContext | None


class CachedDiT:
    """The DiT of a loaded `Qwen2_5OmniToken2WavModel`, solving windows of several requests at
    once (same length, same left context length)."""

    def __init__(self, dit: Any) -> None:
        self.dit = dit
        self.block = int(dit.block_size)
        self.back = {
            i: int(layer.look_backward_block) * self.block
            for i, layer in enumerate(dit.transformer_blocks)
            if layer.look_backward_block
        }
        self.reach = max(self.back.values(), default=0)
        """Frames before a chunk that its look-back layers read: what a stream keeps."""
        self.frames_solved = 0
        """Frames solved so far, every request's (what tests read: no frame is solved twice)."""

    @torch.inference_mode()
    def solve(self, windows: list[Window], keep_at: int | None) -> tuple[torch.Tensor, list[LeftContext]]:
        """The mel of each window ([B, frames, mel]), and, if `keep_at` (a frame of the window,
        block-aligned) is given, what the chunk starting there must be given of the frames
        before it."""
        dit = self.dit
        b, frames = len(windows), windows[0].noise.shape[0]
        left = windows[0].left.frames if windows[0].left is not None else 0
        device = next(dit.parameters()).device
        self.frames_solved += b * frames
        codes = torch.stack([w.codes for w in windows]).to(device)
        noise = torch.stack([w.noise for w in windows]).to(device)
        # Rows 0..b-1 guided, b..2b-1 null (conditioning dropped), as the reference's input
        # embedding stacks them. What they are conditioned on is the same at every evaluation.
        ref = torch.stack([w.ref for w in windows]).to(device)
        voice = dit.input_embed.spk_encoder(torch.cat([ref, torch.zeros_like(ref)]))
        cond = torch.stack([w.cond for w in windows]).to(device)
        fixed = torch.cat(
            (
                voice.unsqueeze(1).repeat(1, frames, 1),
                torch.cat([dit.text_embed(codes), dit.text_embed(codes, drop_code=True)]),
                torch.cat([cond, torch.zeros_like(cond)]).unsqueeze(1).repeat(1, frames, 1),
            ),
            dim=-1,
        )
        starts = torch.tensor([w.start - left for w in windows], device=device)
        positions = (starts[:, None] + torch.arange(left + frames, device=device)).repeat(2, 1)
        rope = dit.rotary_embed(fixed, positions)  # (cos, sin) over the left context and the window
        own_rope = tuple(r[:, left:] for r in rope)
        blocks = torch.arange(left + frames, device=device) // self.block
        diff = (blocks[None, :] - blocks[:, None]).expand(2 * b, dit.num_attention_heads, -1, -1)
        own_diff = diff[:, :, left:, left:]
        before = [w.left.inputs for w in windows if w.left is not None] if left else []
        kept_in = (
            [
                {i: self._rows([inputs[e][i] for inputs in before]) for i in self.back}
                for e in range(len(before[0]))
            ]
            if before
            else []
        )
        kept_out: list[dict[int, torch.Tensor]] = []

        def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            e = len(kept_out)
            kept_out.append({})
            time = dit.time_embed(t.repeat(2 * b))
            h = dit.input_embed.proj(torch.cat((torch.cat([x, x]), fixed), dim=-1))
            for i, layer in enumerate(dit.transformer_blocks):
                if i in self.back and left:
                    whole = torch.cat([kept_in[e][i], h], dim=1)
                    h = layer(whole, time, position_embeddings=rope, block_diff=diff)[:, left:]
                else:
                    whole = h
                    h = layer(h, time, position_embeddings=own_rope, block_diff=own_diff)
                if i in self.back and keep_at is not None:
                    at = left + keep_at
                    kept_out[e][i] = whole[:, max(0, at - self.reach) : at].clone()
            out = dit.proj_out(dit.norm_out(h, time))
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * GUIDANCE

        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        t = torch.linspace(0, 1, STEPS, device=device, dtype=cond.dtype)
        t = t + SWAY * (torch.cos(torch.pi / 2 * t) - 1 + t)
        mel = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1]
        if keep_at is None:
            return mel, []
        return mel, [
            LeftContext(tuple({i: torch.stack([k[i][r], k[i][b + r]]) for i in k} for k in kept_out))
            for r in range(b)
        ]

    @staticmethod
    def _rows(per_window: list[torch.Tensor]) -> torch.Tensor:
        """Windows' [2, n, h] as the batch's rows: every guided row, then every null row."""
        return torch.stack(per_window, dim=1).flatten(0, 1)
