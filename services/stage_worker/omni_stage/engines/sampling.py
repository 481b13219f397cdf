"""Choosing the next token from logits: greedy at temperature 0, else temperature and top-p
sampling from the request's own generator (seeded by its `seed`), for every step-loop engine."""

from __future__ import annotations

from typing import Final

import torch

GREEDY_BELOW: Final = 1e-5
"""A temperature below this is greedy (as vLLM's sampler does): dividing logits by a tiny one
overflows them to inf, and a softmax of infs is NaN."""


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """`logits` [vocab], float32."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
