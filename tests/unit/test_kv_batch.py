"""Prompts prefilled together (`kv_batch.prefill_together`) against each prefilled alone: a
small Qwen2 decoder of transformers (random weights: what is compared is the batching, not the
model). Right-padded, unmasked, each row computes what it computes alone, and its cache, cut
at its length, steps on as its own."""

from __future__ import annotations

import torch
from transformers import DynamicCache, Qwen2Model

from omni_stage.engines.kv_batch import by_length, decode_together, prefill_together


@torch.inference_mode()
def test_prompts_prefilled_together_compute_what_each_computes_alone(decoder: Qwen2Model) -> None:
    """Three prompts of 5, 9 and 2 tokens (M-RoPE-like position rows offset per prompt, as a
    thinker's are): every real position's hidden state and cached keys and values equal the
    prompt's own forward's; then a decode step of the three together on those caches equals
    each one's step alone."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 16, (1, n), generator=gen) for n in (5, 9, 2)]
    positions = [torch.arange(n)[None] + 3 * i for i, n in enumerate((5, 9, 2))]
    alone = [
        decoder(input_ids=ids, position_ids=p, past_key_values=DynamicCache(), use_cache=True)
        for ids, p in zip(prompts, positions, strict=True)
    ]
    out, caches = prefill_together(decoder, positions, prompts)
    assert out.last_hidden_state.shape[:2] == (3, 9)
    for row, (a, cache, ids) in enumerate(zip(alone, caches, prompts, strict=True)):
        n = ids.shape[1]
        torch.testing.assert_close(out.last_hidden_state[row, :n], a.last_hidden_state[0], rtol=0, atol=1e-6)
        assert cache.get_seq_length() == n
        for mine, theirs in zip(cache.layers, a.past_key_values.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-6)
            torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-6)

    nxt = torch.randint(0, 16, (3, 1), generator=gen)
    steps = [p[:, -1:] + 1 for p in positions]
    together, _ = decode_together(decoder, caches, steps, input_ids=nxt)
    for row, (a, step) in enumerate(zip(alone, steps, strict=True)):
        own = decoder(input_ids=nxt[row : row + 1], position_ids=step, past_key_values=a.past_key_values)
        torch.testing.assert_close(
            together.last_hidden_state[row, -1], own.last_hidden_state[0, -1], rtol=0, atol=1e-5
        )


def test_prompts_are_grouped_by_length_within_the_budget() -> None:
    """Each group's positions padded to its longest (its size times that length) within the
    budget, the shortest together first; a prompt past it alone; a budget of one, each alone."""
    assert by_length([100, 30, 40, 35, 300], 128) == [[1, 3, 2], [0], [4]]
    assert by_length([10, 10, 10], 2048) == [[0, 1, 2]]
    assert by_length([5, 3], 1) == [[1], [0]]
