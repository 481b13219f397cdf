"""A Qwen3 talker's multi-codebook frames: the first code drawn by the talker, the others by its
code predictor from the hidden state that drew it; a frame goes back into the talker as its
codes' embeddings summed. Functions of the loaded talker model (`…TalkerForConditionalGeneration`,
with its `code_predictor`), kept apart from the stage so a model whose talker has the same
shape (Qwen3-TTS's) reads the same code."""

from __future__ import annotations

from typing import Any

import torch


def residual_codes(talker: Any, hidden: torch.Tensor, code0: list[int], groups: int) -> list[list[int]]:
    """Each frame's codes after its first, as the reference draws them: the code predictor's
    greedy generate on a batch of equal-length prompts (`hidden` [B, 1, H], the state that drew
    each first code, and that code's embedding)."""
    first = torch.tensor([[c] for c in code0], device=hidden.device)
    drawn = predict(talker, torch.cat([hidden, talker.get_input_embeddings()(first)], dim=1), groups)
    return [row[-(groups - 1) :].tolist() for row in drawn]


def predict(talker: Any, inputs: torch.Tensor, groups: int) -> torch.Tensor:
    """The code predictor's greedy codes after `inputs` ([B, 2, H]: a code's hidden state and
    its embedding)."""
    return talker.code_predictor.generate(inputs_embeds=inputs, max_new_tokens=groups - 1, do_sample=False)


def frame_embedding(talker: Any, codes: list[int]) -> torch.Tensor:
    """[1, 1, H]: a frame's codes (first, then the code predictor's), each through its own
    table, summed: the talker's input for the frame."""
    device = talker.get_input_embeddings().weight.device
    tables = [talker.get_input_embeddings(), *talker.code_predictor.get_input_embeddings()]
    each = [t(torch.tensor([[c]], device=device)) for t, c in zip(tables, codes, strict=True)]
    return torch.cat(each, dim=1).sum(1, keepdim=True)
