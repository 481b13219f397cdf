"""Choosing the next token from logits, for every step-loop engine: OpenAI's sampling fields
applied as vLLM's sampler applies them, so a request means the same on every engine.

In order: `logit_bias` is added to the logits; `frequency_penalty` (times the token's count so
far in the reply) and `presence_penalty` (once it has appeared) are subtracted; then greedy at
temperature 0, else temperature and top-p sampling from the request's own generator (seeded by
its `seed`, else at random), among the tokens a `response_format` grammar allows next (structured.py).
`logprobs` are of the model's own distribution, before any of that (vLLM's default,
`raw_logprobs`).
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_stage.engines import structured
from omni_stage.engines.base import InvalidRequest
from omni_stage.engines.structured import JsonConstraint, JsonGrammars, schema_of

GREEDY_BELOW: Final = 1e-5
"""A temperature below this is greedy (as vLLM's sampler does): dividing logits by a tiny one
overflows them to inf, and a softmax of infs is NaN."""

_SAMPLING: Final = ("temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty")
HONOURED: Final = frozenset(
    (
        *_SAMPLING,
        "logit_bias",
        "logprobs",
        "top_logprobs",
        *(("response_format",) if structured.AVAILABLE else ()),
    )
)
"""What a step-loop engine with a tokenizer honours of a request (`Engine.honours`): JSON mode
where xgrammar is installed."""


@dataclass(frozen=True, slots=True)
class Choice:
    """A picked token, and where the request asked for them, its log probability under the
    model and the `top` most likely tokens at its position (ids and log probabilities)."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class TokenSampler:
    """One request's choices of next token, with what they depend on: its generator and the
    counts of the tokens it has picked."""

    def __init__(
        self,
        sampling: dict[str, Any],
        vocab_size: int,
        grammars: JsonGrammars | None = None,
        schema: str | None = None,
    ) -> None:
        """`schema`: the JSON schema the reply must follow (a tool choice's), if not the
        request's `response_format`."""
        self.temperature = float(sampling.get("temperature", 0.0) or 0.0)
        self.top_p = float(sampling.get("top_p", 1.0) or 1.0)
        seed = sampling.get("seed")  # unseeded: a draw of its own, as vLLM samples it
        self.generator = torch.Generator().manual_seed(
            int(seed) if seed is not None else secrets.randbits(63)
        )
        self.frequency_penalty = float(sampling.get("frequency_penalty", 0.0) or 0.0)
        self.presence_penalty = float(sampling.get("presence_penalty", 0.0) or 0.0)
        self.logprobs: int | None = (
            int(sampling.get("top_logprobs") or 0) if sampling.get("logprobs") else None
        )
        self.bias: dict[int, float] = {}
        for key, value in (sampling.get("logit_bias") or {}).items():
            token = int(key)
            if not 0 <= token < vocab_size:
                raise InvalidRequest(
                    f"logit_bias: token {token} is not in the vocabulary (0 to {vocab_size - 1})"
                )
            self.bias[token] = float(value)
        self.counts: Counter[int] = Counter()
        self.constraint: JsonConstraint | None = None
        if response_format := sampling.get("response_format"):
            schema = schema or schema_of(response_format)
        if schema is not None:
            if grammars is None:
                raise InvalidRequest("response_format: not honoured by this model's engine")
            self.constraint = grammars.constraint(schema)

    def pick(self, logits: torch.Tensor) -> Choice:
        """`logits` [vocab], float32: the model's scores for the next token."""
        logits = logits.float()
        adjusted = logits
        if (
            self.constraint
            or self.bias
            or (self.counts and (self.frequency_penalty or self.presence_penalty))
        ):
            adjusted = logits.clone()
            if self.constraint is not None:
                self.constraint.mask(adjusted)
            for token, bias in self.bias.items():
                adjusted[token] += bias
            if self.counts:
                ids = torch.tensor(list(self.counts))
                n = torch.tensor(list(self.counts.values()), dtype=adjusted.dtype)
                adjusted[ids] -= self.frequency_penalty * n + self.presence_penalty
        token = _pick_token(adjusted, self.temperature, self.top_p, self.generator)
        self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.logprobs is None:
            return Choice(token)
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, self.logprobs) if self.logprobs else None
        return Choice(
            token,
            float(logprobs[token]),
            list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else [],
        )


def _pick_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
