"""A reply's text as its tokens come, for every engine that detokenizes its own output."""

from __future__ import annotations

from typing import Any

import torch

from omni_pipeline.control import PromptLogprob, PromptLogprobs, TokenLogprob
from omni_pipeline.sampling import Sampling
from omni_stage.engines.sampling import Choice


class ReplyText:
    """Whole characters only, never past a stop string (OpenAI's `stop`: the text ends before
    it; with vLLM's `include_stop_str_in_output`, after it), and the last few characters held
    back while they could still be the start of one. Special tokens are left out unless
    `skip_special_tokens` is false (vLLM's; then `spaces_between_special_tokens` says whether
    they are spaced from the text around them)."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        include_stop: bool = False,
        skip_special: bool = True,
        spaced_special: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.include_stop = include_stop
        self.decode_args = {"skip_special_tokens": skip_special}
        if not skip_special and not spaced_special:
            self.decode_args["spaces_between_special_tokens"] = False
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0

    @classmethod
    def for_request(cls, tokenizer: Any, sampling: Sampling) -> ReplyText:
        return cls(
            tokenizer,
            [x for x in sampling.stop or [] if x],
            include_stop=bool(sampling.include_stop_str_in_output),
            skip_special=sampling.skip_special_tokens is not False,
            spaced_special=sampling.spaces_between_special_tokens is not False,
        )

    def add(self, token: int | None, last: bool) -> tuple[str, bool]:
        """This token's text delta (`token` None: the reply ended without one), and whether a
        stop string ended the reply here."""
        if token is not None:
            self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens, **self.decode_args)
        if full.endswith("\ufffd") and not last:
            return "", False  # an incomplete UTF-8 sequence; wait for the next byte
        cuts = [i + (len(x) if self.include_stop else 0) for x in self.stops if (i := full.find(x)) >= 0]
        end = min(cuts) if cuts else len(full) if last else max(self.sent, len(full) - self.hold)
        delta, self.sent = full[self.sent : max(self.sent, end)], max(self.sent, end)
        return delta, bool(cuts)


def token_logprobs(tokenizer: Any, choice: Choice) -> list[TokenLogprob]:
    """The choice's log probability as the client sees it (token text, not ids); none where the
    request did not ask."""
    if choice.logprob is None:
        return []
    top = [(tokenizer.decode([t]), lp) for t, lp in choice.top]
    return [TokenLogprob(tokenizer.decode([choice.token]), choice.logprob, top)]


def prompt_logprobs(tokenizer: Any, ids: list[int], logits: torch.Tensor, top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` from the model's logits over the prompt (row i predicts token
    i + 1): at each position after the first, the prompt's own token (its log probability and
    rank) and the `top` likeliest others, as vLLM reports them."""
    lp = torch.log_softmax(logits[: len(ids) - 1].float(), dim=-1)
    target = torch.tensor(ids[1:], device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(1) + 1
    best = torch.topk(lp, top) if top else None
    out: PromptLogprobs = [None]
    for i, tok in enumerate(ids[1:]):
        row = [PromptLogprob(tok, float(chosen[i]), int(ranks[i]), tokenizer.decode([tok]))]
        if best is not None:
            row += [
                PromptLogprob(t, float(v), rank, tokenizer.decode([t]))
                for rank, (t, v) in enumerate(
                    zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True), 1
                )
                if t != tok
            ]
        out.append(row)
    return out
