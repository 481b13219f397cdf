"""A prefill's logits at the position its next token is picked from, not at every position.

A prompt's forward computes its hidden states at every position (the cache and the talker
read them), but its next token reads the logits of one: the last. Mapping all of them through
the vocabulary's head is most of a small model's prefill (the tiny Qwen2.5-Omni thinker's 64
wide layers against its 8465 rows of vocabulary: 52% of a prompt of 100 alone, 73% of eight
together, measured) and, at Qwen2.5-Omni-7B's 152064 rows, a 2048-position prefill's logits
would be 0.6 GB in bf16 for the eight rows a batch reads. The omni thinkers' and
Qwen2.5-Omni's talker's forwards (transformers' own) take no `logits_to_keep`, and prompts
prefilled together end at a different position in each row, which `logits_to_keep` (one set
of positions for every row) cannot say; so the head's input is cut to those positions as the
forward calls it (a forward pre-hook, removed on the way out).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def last_logits(head: torch.nn.Module | None, lasts: list[int] | None = None) -> Iterator[None]:
    """Within it, `head` (the module that maps a forward's last hidden states [B, n, H] to its
    logits) maps row i's position `lasts[i]` alone (without `lasts`: every row's last): the
    forward's logits are [B, 1, vocab]. None: nothing changes (prompt log probabilities read
    every position)."""
    if head is None:
        yield
        return

    def at_lasts(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, *rest = args
        assert lasts is None or hidden.shape[0] == len(lasts), (hidden.shape, lasts)
        if lasts is None or all(last == hidden.shape[1] - 1 for last in lasts):  # (a view)
            return (hidden[:, -1:], *rest)
        rows = torch.arange(len(lasts), device=hidden.device)
        return (hidden[rows, torch.tensor(lasts, device=hidden.device)][:, None], *rest)

    handle = head.register_forward_pre_hook(at_lasts)
    try:
        yield
    finally:
        handle.remove()
