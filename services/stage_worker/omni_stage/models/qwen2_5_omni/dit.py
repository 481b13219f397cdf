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
The solve goes one Runge-Kutta step (four evaluations) at a time (`CachedDiT.step`), each call
a batch of windows of one shape whatever step each is at (each row its own time), so a
replica's compute thread can take a newcomer's first chunk between two steps of others' chunks
rather than after their whole solve.

Those kept frames were solved before the chunk after them was known beyond the right context,
so on a trained checkpoint a chunk is close to the whole decode, not equal to it; on the tiny
one it is within 1e-6 (tests/unit/test_qwen_omni.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass(slots=True, eq=False)
class Solve:
    """One window's solve between its steps."""

    window: Window
    keep_at: int | None
    """A frame of the window (block-aligned) where the next chunk starts: what that chunk's
    look-back layers read before it is kept. None: no chunk follows."""
    x: torch.Tensor
    """The current value, [frames, mel]: the noise at first, the mel once every step is done."""
    fixed: torch.Tensor
    """What every evaluation is conditioned on, guided and null rows ([2, frames, features])."""
    step: int = 0
    kept: list[dict[int, torch.Tensor]] = field(default_factory=list)
    """What the next chunk reads, per evaluation so far: layer -> [2, frames, hidden]."""

    @property
    def solved(self) -> bool:
        return self.step == STEPS - 1

    def left_context(self) -> LeftContext:
        return LeftContext(tuple(self.kept))


class CachedDiT:
    """The DiT of a loaded `Qwen2_5OmniToken2WavModel`, stepping the solves of several requests
    at once (of one length and left context length, each at its own step)."""

    def __init__(self, dit: Any, compiled: Callable[[Any], Any] = lambda module: module) -> None:
        self.dit = dit
        self.layers = [compiled(b) for b in dit.transformer_blocks]
        """The DiT's layers, compiled by `torch.compile` where asked (`compile`)."""
        self.block = int(dit.block_size)
        self.back = {
            i: int(layer.look_backward_block) * self.block
            for i, layer in enumerate(dit.transformer_blocks)
            if layer.look_backward_block
        }
        self.reach = max(self.back.values(), default=0)
        """Frames before a chunk that its look-back layers read: what a stream keeps."""
        t = torch.linspace(0, 1, STEPS)
        self.times = t + SWAY * (torch.cos(torch.pi / 2 * t) - 1 + t)
        self.frames_solved = 0
        """Frames solved so far, every request's (what tests read: no frame is solved twice)."""

    @property
    def device(self) -> torch.device:
        return next(self.dit.parameters()).device

    def to(self, device: torch.device | str) -> CachedDiT:
        """Moves its DiT (a level-1 sleep); the compiled layers wrap the same modules."""
        self.dit.to(device)
        return self

    @torch.inference_mode()
    def begin(self, windows: list[Window], keep_at: int | None) -> list[Solve]:
        """The windows' solves, ready for their first step: what they are conditioned on is
        computed here, once (the speaker encoder, the codes' embedding)."""
        dit, b, device = self.dit, len(windows), self.device
        frames = windows[0].noise.shape[0]
        self.frames_solved += b * frames
        codes = torch.stack([w.codes for w in windows]).to(device)
        # Rows 0..b-1 guided, b..2b-1 null (conditioning dropped), as the reference's input
        # embedding stacks them.
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
        return [
            Solve(w, keep_at, w.noise.to(device), torch.stack([fixed[r], fixed[b + r]]))
            for r, w in enumerate(windows)
        ]

    @torch.inference_mode()
    def step(self, solves: list[Solve]) -> None:
        """One Runge-Kutta step of each solve (of the same shape, each at its own step: its time
        is its row's), as the reference's solver takes it; each solve's value and what it keeps
        are updated."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit, b, device = self.dit, len(solves), self.device
        first = solves[0]
        frames = first.x.shape[0]
        left = first.window.left.frames if first.window.left is not None else 0
        fixed = self._rows([s.fixed for s in solves])
        starts = torch.tensor([s.window.start - left for s in solves], device=device)
        positions = (starts[:, None] + torch.arange(left + frames, device=device)).repeat(2, 1)
        rope = dit.rotary_embed(fixed, positions)  # (cos, sin) over the left context and the window
        own_rope = tuple(r[:, left:].contiguous() for r in rope)  # (strides: see block_diff)
        blocks = torch.arange(left + frames, device=device) // self.block

        def block_diff(blocks: torch.Tensor) -> torch.Tensor:
            # Each its own expand, not a slice of the other's: a compiled layer is guarded on
            # the strides of its inputs (one compile, not one per stride).
            return (blocks[None, :] - blocks[:, None]).expand(2 * b, dit.num_attention_heads, -1, -1)

        diff, own_diff = block_diff(blocks), block_diff(blocks[left:])
        keep_at = first.keep_at
        kept: list[dict[int, torch.Tensor]] = []

        def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            j = len(kept)  # the step's evaluation; the solve's is 4 * step + j
            kept.append({})
            time = dit.time_embed(t.reshape(-1).repeat(2))
            h = dit.input_embed.proj(torch.cat((torch.cat([x, x]), fixed), dim=-1))
            for i, layer in enumerate(self.layers):
                if i in self.back and left:
                    before = self._rows([s.window.left.inputs[4 * s.step + j][i] for s in solves])  # type: ignore[union-attr]
                    whole = torch.cat([before, h], dim=1)
                    # Contiguous, as the next layer's input is without left context (strides).
                    h = layer(whole, time, position_embeddings=rope, block_diff=diff)[:, left:].contiguous()
                else:
                    whole = h
                    h = layer(h, time, position_embeddings=own_rope, block_diff=own_diff)
                if i in self.back and keep_at is not None:
                    at = left + keep_at
                    kept[-1][i] = whole[:, max(0, at - self.reach) : at].clone()
            out = dit.proj_out(dit.norm_out(h, time))
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * GUIDANCE

        x = torch.stack([s.x for s in solves])
        at = torch.tensor([s.step for s in solves])
        t0, t1 = (self.times[at + k].view(-1, 1, 1).to(device) for k in (0, 1))
        solver = RungeKutta4ODESolver(function=velocity, initial_value=x)
        delta, _ = solver._compute_step(velocity, t0, t1 - t0, t1, x)
        x = x + delta
        for r, s in enumerate(solves):
            s.x = x[r]
            s.kept += [{i: torch.stack([k[i][r], k[i][b + r]]) for i in k} for k in kept]
            s.step += 1

    @staticmethod
    def _rows(per_window: list[torch.Tensor]) -> torch.Tensor:
        """Windows' [2, ...] as the batch's rows: every guided row, then every null row."""
        return torch.stack(per_window, dim=1).flatten(0, 1)
