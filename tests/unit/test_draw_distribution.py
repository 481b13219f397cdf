"""What a sampled request draws from (`TokenSampler.probs`): the distribution transformers'
own processors make of the logits at its temperature, min-p, top-k and top-p, in vLLM's order
(min-p, then top-k and top-p), token for token; with top-k, its tokens alone sorted for top-p,
the very numbers the whole vocabulary's sort gives (a seed draws the same tokens)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from omni_pipeline.sampling import Sampling
from omni_stage.engines.sampling import TokenSampler, _top_p

VOCAB = 4096


def reference(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """transformers' processors, one after another, and a softmax."""
    scores = logits / (s.temperature or 1.0)
    warpers = [
        *([MinPLogitsWarper(s.min_p)] if s.min_p else []),
        *([TopKLogitsWarper(s.top_k)] if s.top_k and s.top_k > 0 else []),
        *([TopPLogitsWarper(s.top_p)] if s.top_p else []),
    ]
    for warp in warpers:
        scores = warp(torch.empty(scores.shape[0], 0, dtype=torch.long), scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.7, top_p=0.8),
        Sampling(temperature=0.7, top_p=0.8, top_k=20),  # top-p over top-k's tokens alone
        Sampling(temperature=1.0, top_p=0.95, top_k=50, min_p=0.01),
        Sampling(temperature=1.3, top_p=0.999, top_k=5),  # the k reach not top_p: all 5 kept
        Sampling(temperature=1.0, top_p=0.5, top_k=VOCAB),  # k the whole vocabulary
        Sampling(temperature=1.0, top_p=0.9, top_k=-1),
    ],
    ids=lambda s: f"T{s.temperature}-p{s.top_p}-k{s.top_k}-minp{s.min_p}",
)
def test_a_draw_reads_what_transformers_processors_make_of_the_logits(sampling: Sampling) -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    ours = TokenSampler(sampling, VOCAB).probs(logits)
    theirs = reference(logits, sampling)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens may come
    assert 1 < int((ours > 0).sum(-1).min()) < VOCAB  # not vacuous: top-p cut each row
    torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), theirs)
    if sampling.top_p and sampling.top_k:  # top-k's tokens sorted alone: the whole sort's numbers
        before_top_p = TokenSampler(msgspec.structs.replace(sampling, top_p=None), VOCAB).probs(logits)
        assert torch.equal(ours, _top_p(before_top_p, sampling.top_p, 0))


def test_a_token_top_k_keeps_for_a_tie_is_kept_where_the_k_do_not_reach_top_p() -> None:
    """top-k keeps every token tied at its k-th logit (here 3 where k is 2); top-p keeps them
    while the likelier tokens' mass is under top_p, whichever of them top-k's own sort put
    first."""
    logits = torch.tensor([[4.0, 2.0, 2.0, -1.0, -2.0], [4.0, 2.0, 2.0, -1.0, -2.0]])
    wide = TokenSampler(Sampling(temperature=1.0, top_p=0.99, top_k=2), 5).probs(logits[:1])
    narrow = TokenSampler(Sampling(temperature=1.0, top_p=0.5, top_k=2), 5).probs(logits[1:])
    assert (wide[0] > 0).tolist() == [True, True, True, False, False]
    assert (narrow[0] > 0).tolist() == [True, False, False, False, False]
    for probs, p in ((wide, 0.99), (narrow, 0.5)):
        theirs = reference(logits[:1], Sampling(temperature=1.0, top_p=p, top_k=2))
        torch.testing.assert_close(probs / probs.sum(), theirs)
