"""The talkers' repetition penalty from a bool row a slot (`parts.SeenCodes`) picks what
transformers' own processor, fed each request's codes as a list, picks: the same logits
exactly, whatever slots the requests hold and however the rows grew."""

from __future__ import annotations

import torch

from omni_stage.models.qwen_omni.parts import REPETITION_PENALTY, SeenCodes, code_mask

VOCAB = 64


def reference(logits: torch.Tensor, seen: list[list[int]], never: list[int]) -> list[int]:
    """transformers' RepetitionPenaltyLogitsProcessor a row at a time, `never` masked out."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(REPETITION_PENALTY)
    picks = []
    for row, codes in zip(logits, seen, strict=True):
        scores = row[None].clone()
        if codes:
            scores = penalty(torch.tensor([codes]), scores)
        scores[0, never] = -float("inf")
        picks.append(int(scores.argmax(-1)))
    return picks


def test_picks_equal_transformers_processor_at_any_slot() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = SeenCodes(VOCAB, torch.device("cpu"))
    never = [VOCAB - 2, VOCAB - 1]
    slots = [5, 0, 2]  # past the rows' size at first: they grow
    seen: dict[int, list[int]] = {s: [] for s in slots}
    for s in slots:
        rows.start(s, [3] if s == 2 else [])  # what a request saw before its first pick
        seen[s] = [3] if s == 2 else []
    assert rows.rows.shape[0] >= 6
    for _ in range(40):
        # logits near each other, both signs: the penalty decides many picks
        logits = torch.randn(len(slots), VOCAB, generator=gen) * 0.05
        expected = reference(logits, [seen[s] for s in slots], never)
        picked = rows.greedy(logits, slots, code_mask(VOCAB, never, torch.device("cpu")))
        assert picked == expected
        for s, code in zip(slots, picked, strict=True):
            seen[s].append(code)
    assert any(len(set(codes)) < len(codes) for codes in seen.values())  # codes came again: penalised
    rows.start(0)  # a new request at a slot given back sees nothing of the last one's
    assert not rows.rows[0].any() and rows.rows[5].any()
