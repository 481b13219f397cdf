"""A batch's tokens picked at once (`pick_together`) are what each request's own `pick` picks."""

from __future__ import annotations

from collections import Counter

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
    Sampling(temperature=1.0, seed=7),  # sampled: drawn with the batch
    Sampling(logprobs=True, top_logprobs=2),  # greedy, but with log probabilities: its own
    Sampling(logit_bias={"9": 50.0}),  # adjusted: its own
    Sampling(min_tokens=2),
    Sampling(temperature=1.0, seed=8),  # drawn with the batch, alike the third
    Sampling(temperature=0.7, top_p=0.8, top_k=6, min_p=0.05, seed=9, min_tokens=2),  # with bans
    Sampling(temperature=1.3, top_p=0.5),  # unseeded
    Sampling(temperature=1.0, seed=7, presence_penalty=0.5),  # sampled, adjusted: its own
]


def samplers() -> list[TokenSampler]:
    return [TokenSampler(s, VOCAB, eos=frozenset({EOS}), prompt=[1, 2]) for s in REQUESTS]


def test_a_batch_picks_what_each_request_picks_alone() -> None:
    """Requests of every kind over steps whose logits favour the banned tokens (an end before
    `min_tokens`), greedy and sampled rows among them (drawn together where alike), rows
    with a NaN and with +inf (which a row's own pick handles, a sampled one with the number
    it drew): the same choices, log probabilities included, and the same state after (the
    reply, the counts the penalties read, the generators)."""
    g = torch.Generator().manual_seed(0)
    alone, together = samplers(), samplers()
    for a, b in zip(alone, together, strict=True):  # an unseeded request's: the same numbers both ways
        b.generator.set_state(a.generator.get_state())
    for step in range(8):
        logits = torch.randn(len(REQUESTS), VOCAB, generator=g)
        logits[:6, EOS] += 10.0
        logits[:6, 5] += 5.0
        logits[6:, EOS] += 2.0  # (the later rows' draws wander)
        if step == 1:
            logits[0, 7] = float("nan")
            logits[5, 8] = float("inf")
            logits[6, 9] = float("nan")
            logits[7, 10] = float("inf")
        ours = pick_together(together, logits.clone())
        theirs = [s.pick(logits[i].clone()) for i, s in enumerate(alone)]
        assert ours == theirs
    for a, b in zip(alone, together, strict=True):
        assert (a.reply, a.counts, list(a.seen)) == (b.reply, b.counts, list(b.seen))
        assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert together[1].reply[:3] != [EOS] * 3 and together[0].reply[0] == EOS  # the bans held
    assert EOS not in together[7].reply[:2]
    assert all(len(set(s.reply)) > 2 for s in together[6:9])  # not vacuous: the draws wander


def test_a_draw_takes_each_token_as_often_as_its_probability_and_never_one_of_none() -> None:
    """20,000 draws of one request (seeded) from a distribution with tokens of probability 0
    among the others: each token as often as its probability within 0.01, none of those at 0;
    and each draw is the one `torch.multinomial` draws with a generator of the same seed (a
    seed speaks as it did when each row drew its own there)."""
    logits = torch.tensor([-torch.inf, 0.0, -torch.inf, 1.0, 2.0, -torch.inf, 0.5, -torch.inf])
    sampler = TokenSampler(Sampling(temperature=1.0, seed=3), len(logits))
    twin = torch.Generator().manual_seed(3)
    probs = torch.softmax(logits, -1)
    drawn = [sampler.pick(logits).token for _ in range(20_000)]
    assert drawn == [int(torch.multinomial(probs, 1, generator=twin)) for _ in range(20_000)]
    counts = Counter(drawn)
    assert set(counts) == {1, 3, 4, 6}
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 20_000 - p) < 0.01, (token, counts[token], p)


def test_a_row_that_leaves_nothing_to_pick_is_refused_as_alone_and_no_row_is_taken() -> None:
    """The batch fails as that row alone would, before any other row's token is taken: run
    again a request at a time (as a step batcher does), each picks as if the batch had not run."""
    logits = torch.full((2, VOCAB), -torch.inf)
    logits[:, EOS] = 1.0  # only the end, which min_tokens bans
    greedy = TokenSampler(Sampling(), VOCAB)
    with pytest.raises(InvalidRequest, match="leave no token that may come next"):
        pick_together([greedy, samplers()[1]], logits)
    assert greedy.reply == [] and not greedy.counts


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
