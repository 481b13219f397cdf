"""A batch's tokens picked at once (`pick_together`) are what each request's own `pick` picks."""

from __future__ import annotations

import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import InvalidRequest
from omni_stage.engines.sampling import TokenSampler, pick_together

VOCAB = 32
EOS = 3
REQUESTS = [
    Sampling(),  # greedy: picked with the batch
    Sampling(min_tokens=3, stop_token_ids=[5]),  # greedy with bans until its third token
    Sampling(temperature=1.0, seed=7),  # sampled: its own pick
    Sampling(logprobs=True, top_logprobs=2),  # greedy, but with log probabilities: its own
    Sampling(logit_bias={"9": 50.0}),  # adjusted: its own
    Sampling(min_tokens=2),
]


def samplers() -> list[TokenSampler]:
    return [TokenSampler(s, VOCAB, eos=frozenset({EOS}), prompt=[1, 2]) for s in REQUESTS]


def test_a_batch_picks_what_each_request_picks_alone() -> None:
    """Six requests of every kind over steps whose logits favour the banned tokens (an end
    before `min_tokens`), one row with a NaN and one with +inf (which a row's own pick
    handles): the same choices, log probabilities included, and the same state after (the
    reply, the counts the penalties read)."""
    g = torch.Generator().manual_seed(0)
    alone, together = samplers(), samplers()
    for step in range(5):
        logits = torch.randn(len(REQUESTS), VOCAB, generator=g)
        logits[:, EOS] += 10.0
        logits[:, 5] += 5.0
        if step == 1:
            logits[0, 7] = float("nan")
            logits[5, 8] = float("inf")
        ours = pick_together(together, logits.clone())
        theirs = [s.pick(logits[i].clone()) for i, s in enumerate(alone)]
        assert ours == theirs
    for a, b in zip(alone, together, strict=True):
        assert (a.reply, a.counts, list(a.seen)) == (b.reply, b.counts, list(b.seen))
    assert together[1].reply[:3] != [EOS] * 3 and together[0].reply[0] == EOS  # the bans held


def test_a_row_that_leaves_nothing_to_pick_is_refused_as_alone() -> None:
    logits = torch.full((2, VOCAB), -torch.inf)
    logits[:, EOS] = 1.0  # only the end, which min_tokens bans
    with pytest.raises(InvalidRequest, match="leave no token that may come next"):
        pick_together([TokenSampler(Sampling(), VOCAB), samplers()[1]], logits)


def test_a_batch_of_greedy_requests_with_bans_leaves_the_logits_as_they_were() -> None:
    """Every row picked with the batch (the logits read in place, not copied), two of them
    with bans: the choices are each row's own, and the caller's logits are not written."""
    kinds = [Sampling(), Sampling(min_tokens=2), Sampling(min_tokens=2, stop_token_ids=[5])]
    logits = torch.randn(len(kinds), VOCAB, generator=torch.Generator().manual_seed(1))
    logits[:, EOS] += 10.0
    before = logits.clone()
    ours = pick_together([TokenSampler(s, VOCAB, eos=frozenset({EOS})) for s in kinds], logits)
    theirs = [TokenSampler(s, VOCAB, eos=frozenset({EOS})).pick(logits[i]) for i, s in enumerate(kinds)]
    assert ours == theirs and ours[0].token == EOS and ours[1].token != EOS
    assert torch.equal(logits, before)
