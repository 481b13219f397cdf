"""A Qwen3 talker's multi-codebook frames: the first code drawn by the talker, the others by its
code predictor from the hidden state that drew it; a frame goes back into the talker as its
codes' embeddings summed. Functions of the loaded talker model (`…TalkerForConditionalGeneration`,
with its `code_predictor`), kept apart from the stage so a model whose talker has the same
shape (Qwen3-TTS's) reads the same code."""

from __future__ import annotations

import logging
from typing import Any

import torch

from omni_stage.engines.fixed_steps import buckets_up_to, graphed

LOG = logging.getLogger(__name__)


def frames_embedding(talker: Any, codes: torch.Tensor) -> torch.Tensor:
    """[1, T, H]: each frame of `codes` [T, groups] (first, then the code predictor's), each
    code through its own table, summed: the talker's input for the frame (T frames of one
    request, or one frame each of T requests)."""
    tables = [talker.get_input_embeddings(), *talker.code_predictor.get_input_embeddings()]
    each = [t(codes[:, g : g + 1]) for g, t in zip(range(codes.shape[1]), tables, strict=True)]
    return torch.cat(each, dim=1).sum(1)[None]


class StaticFrames:
    """The code predictor's frames at fixed shapes: a batch padded up to its bucket, a cache of
    the frame's length allocated once per bucket, the sub-steps a fixed loop, greedy, computing
    what transformers' `generate` on the code predictor computes, without its per-call work
    (1.6 times the frames a second on this CPU, tiny model). On CUDA (`capture`) each bucket's
    whole frame, prefill and every sub-step, is captured as one CUDA graph at start and
    replayed: one launch a frame instead of some thousand (eager, a frame of the real model's
    15 sub-steps took 99 ms of an H200's host time: docs/benchmarks.md, GPU)."""

    def __init__(self, talker: Any, groups: int, max_batch: int, capture: bool) -> None:
        from transformers import StaticCache

        self.talker = talker
        self.groups = groups
        self.buckets = buckets_up_to(max_batch)  # a frame's batch padded up to one
        p = talker.get_input_embeddings().weight
        width = int(p.shape[1])  # a frame's rows are the talker's (a code predictor may project them)
        config = talker.code_predictor.config
        self._inputs = {b: torch.zeros(b, 2, width, device=p.device, dtype=p.dtype) for b in self.buckets}
        # The frame's positions: its two prompt rows, then one a sub-step but the last's.
        self._caches = {b: StaticCache(config=config, max_cache_len=groups) for b in self.buckets}
        heads, dim = config.num_key_value_heads, config.head_dim
        for b, cache in self._caches.items():  # now, not at its first frame: one form for a compile
            cache.early_initialization(b, heads, dim, p.dtype, p.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            for b in self.buckets:
                self._graphs[b] = graphed(lambda b=b: self._frame(b))

    @classmethod
    @torch.inference_mode()  # as requests run them: the frames' caches are inference tensors
    def built(cls, talker: Any, groups: int, max_batch: int, graphs: bool, stage: str) -> StaticFrames:
        """A talker stage's frames; with `graphs` (its `cudaGraphs: true`, CUDA only) captured,
        or, where the device refuses a capture, the same frames launched. Captures are off by
        default until a GPU has run them (scripts/gpu_graphs.py: not yet, docs/models.md)."""
        if graphs:
            try:
                return cls(talker, groups, max_batch, capture=True)
            except RuntimeError as exc:  # a kernel the capture refuses
                LOG.warning("stage %s: code predictor frames not captured as CUDA graphs: %s", stage, exc)
        return cls(talker, groups, max_batch, capture=False)

    def run_each_bucket(self) -> None:
        """One frame at each bucket (what a compiled code predictor compiles at start)."""
        p = self.talker.get_input_embeddings().weight
        for b in self.buckets:
            self.residuals(
                torch.zeros(b, 1, self._inputs[b].shape[-1], device=p.device, dtype=p.dtype), [0] * b
            )

    @property
    def captured(self) -> bool:
        """Whether its frames replay as CUDA graphs."""
        return bool(self._graphs)

    def residuals(self, hidden: torch.Tensor, code0: list[int]) -> list[list[int]]:
        """Each frame's codes after its first, as the reference draws them: the code predictor's
        greedy codes after `hidden` ([n, 1, H], the state that drew each first code) and that
        code's embedding."""
        n = len(code0)
        b = next(b for b in self.buckets if b >= n)
        first = torch.tensor([[c] for c in code0], device=hidden.device)
        inputs = self._inputs[b]
        inputs[:n] = torch.cat([hidden, self.talker.get_input_embeddings()(first)], dim=1)
        inputs[n:] = 0  # rows past the batch: computed and dropped
        if b in self._graphs:
            graph, drawn = self._graphs[b]
            graph.replay()
        else:
            drawn = self._frame(b)
        return drawn[:n].tolist()

    def _frame(self, b: int) -> torch.Tensor:
        """[b, groups - 1]: the greedy codes after the bucket's inputs, on its cache."""
        predictor = self.talker.code_predictor
        cache = self._caches[b]
        cache.reset()
        out = predictor(inputs_embeds=self._inputs[b], past_key_values=cache, use_cache=True)
        drawn = [out.logits[:, -1].argmax(-1)]
        for step in range(1, self.groups - 1):
            out = predictor(
                input_ids=drawn[-1][:, None], past_key_values=cache, use_cache=True, generation_steps=step
            )
            drawn.append(out.logits[:, -1].argmax(-1))
        return torch.stack(drawn, dim=1)
