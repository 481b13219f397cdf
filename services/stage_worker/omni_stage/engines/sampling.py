"""Choosing the next token from logits, for every step-loop engine: OpenAI's sampling fields
and vLLM's extensions applied as vLLM's sampler applies them, so a request means the same on
every engine.

In order: tokens outside `allowed_token_ids`, a `bad_words` sequence's last token where the reply
ends with the rest of it, and (before `min_tokens` tokens) every token that would end the reply
are masked; so is what a `response_format` / `structured_outputs` grammar forbids next
(structured.py); `logit_bias` is added; `repetition_penalty` divides the logits of tokens seen in
the prompt or reply (multiplies, where negative), `frequency_penalty` (times the token's count
so far in the reply) and `presence_penalty` (once it has appeared) are subtracted. Then greedy
at temperature 0, else temperature, `min_p`, `top_k` and `top_p`, and a draw: the token whose
probability over an exponential number of the request's own generator (seeded by its `seed`,
else at random) is largest, what `torch.multinomial` draws for one sample (the same tokens for
a seed as it draws); the numbers are drawn on the logits' device, so that a batch's rows are
drawn at once there, nothing read back, each what it draws alone. Repetition, min-p and top-k are
transformers' own logits processors, which compute what vLLM's do. `logprobs` are of the model's
own distribution, before any of that (vLLM's default, `raw_logprobs`).

A reply ends at an end-of-sequence token (unless `ignore_eos`) or at one of `stop_token_ids`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_pipeline.sampling import Sampling, params
from omni_stage.engines import structured
from omni_stage.engines.base import InvalidRequest, seeded
from omni_stage.engines.structured import JsonConstraint, JsonGrammars

GREEDY_BELOW: Final = 1e-5
"""A temperature below this is greedy (as vLLM's sampler does): dividing logits by a tiny one
overflows them to inf, and a softmax of infs is NaN."""

SAMPLER_EXTENSIONS: Final = params(
    "prompt_logprobs",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
)
"""vLLM's sampling extensions this sampler applies."""
REPLY_EXTENSIONS: Final = params(
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"
)
"""vLLM's fields for how a reply's tokens become its text (reply.py)."""
PROMPT_EXTENSIONS: Final = params("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""vLLM's fields for how chat messages become the prompt (the chat template's own arguments)."""
HONOURED: Final = params(
    ("temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty"),
    ("logit_bias", "logprobs", "top_logprobs"),
    SAMPLER_EXTENSIONS,
    REPLY_EXTENSIONS,
    PROMPT_EXTENSIONS,
    ("response_format", "structured_outputs") if structured.AVAILABLE else (),
)
"""What a step-loop engine with a tokenizer honours of a request (`Engine.honours`): grammars
where xgrammar is installed. An engine that reads text prompts adds `truncate_prompt_tokens`."""


@dataclass(frozen=True, slots=True)
class Choice:
    """A picked token, and where the request asked for them, its log probability under the
    model and the `top` most likely tokens at its position (ids and log probabilities)."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class TokenSampler:
    """One request's choices of next token, with what they depend on: its generator, the tokens
    of its prompt and the counts of the tokens it has picked."""

    def __init__(
        self,
        sampling: Sampling,
        vocab_size: int,
        grammars: JsonGrammars | None = None,
        schema: str | None = None,
        *,
        eos: frozenset[int] = frozenset(),
        prompt: list[int] | None = None,
        tokenizer: Any = None,
    ) -> None:
        """`schema`: the JSON schema the reply must follow (a tool choice's), if not the
        request's own grammar. `eos`: the model's end-of-sequence tokens. `prompt`: its token
        ids, which `repetition_penalty` counts as seen (an embeddings-only prompt: none).
        `tokenizer`: what turns `bad_words` into tokens."""
        self.vocab_size = vocab_size
        self.temperature = sampling.temperature or 0.0
        self.top_p = sampling.top_p or 1.0
        self.top_k = max(sampling.top_k or 0, 0)
        self.drawn_alike = (self.temperature, self.top_p, sampling.min_p or 0.0, self.top_k)
        """What its draw's distribution depends on beside the logits: rows alike are drawn as one."""
        self.generator = seeded(sampling.seed)
        self._device_generator: torch.Generator | None = None
        self.frequency_penalty = sampling.frequency_penalty or 0.0
        self.presence_penalty = sampling.presence_penalty or 0.0
        self.logprobs: int | None = (sampling.top_logprobs or 0) if sampling.logprobs else None
        self.prompt_logprobs: int | None = sampling.prompt_logprobs
        """vLLM's: the prompt's log probabilities, with this many likeliest others (reply.py)."""
        self.bias: dict[int, float] = {
            self._token(int(k), "logit_bias"): v for k, v in (sampling.logit_bias or {}).items()
        }
        self.stop_ids = frozenset(self._token(t, "stop_token_ids") for t in sampling.stop_token_ids or [])
        self.ignore_eos = bool(sampling.ignore_eos)
        self.eos = eos
        self.min_tokens = sampling.min_tokens or 0
        self.allowed: torch.Tensor | None = None
        if (allowed := sampling.allowed_token_ids) is not None:
            if not allowed:
                raise InvalidRequest("allowed_token_ids: at least one token (none leaves nothing to draw)")
            ids = [self._token(t, "allowed_token_ids") for t in allowed]
            self.allowed = torch.tensor(ids, dtype=torch.long)
        self.bad_words = _bad_word_ids(tokenizer, sampling.bad_words or [])
        self.warpers = _warpers(sampling)
        self.repetition = _repetition(sampling)
        self.seen: dict[int, None] = dict.fromkeys(prompt or [])
        """The distinct tokens of the prompt and the reply so far (what repetition_penalty
        penalises, once each), in the order first seen."""
        self.seen_ids = torch.tensor([list(self.seen)], dtype=torch.long)
        self.reply: list[int] = []
        self.counts: Counter[int] = Counter()
        self.constraint: JsonConstraint | None = None
        if grammar := structured.grammar_of(sampling, schema):
            if grammars is None:
                raise InvalidRequest(f"{grammar.field}: not honoured by this model's engine")
            self.constraint = grammars.constraint(grammar)

    def _token(self, token: int, field_name: str) -> int:
        if not 0 <= token < self.vocab_size:
            raise InvalidRequest(
                f"{field_name}: token {token} is not in the vocabulary (0 to {self.vocab_size - 1})"
            )
        return token

    def ends(self, token: int) -> bool:
        """Whether the reply ends at this token: an end of sequence (unless `ignore_eos`), or
        one of its `stop_token_ids`."""
        return (token in self.eos and not self.ignore_eos) or token in self.stop_ids

    @property
    def greedy(self) -> bool:
        """Whether it picks the likeliest token (a temperature below GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Whether its next pick reads the logits with bans at most (`banned`): the likeliest
        token, or a draw at its temperature, top-p, top-k and min-p; nothing else adjusting
        the logits, no log probabilities asked (`pick_together`)."""
        return (
            not self.bias
            and not self.frequency_penalty
            and not self.presence_penalty
            and self.repetition is None
            and self.allowed is None
            and self.constraint is None
            and self.logprobs is None
        )

    def banned(self) -> set[int]:
        """What may not come next: an end before `min_tokens`, a bad word's last token."""
        banned: set[int] = set()
        if len(self.reply) < self.min_tokens:
            banned |= self.stop_ids | (self.eos if not self.ignore_eos else frozenset())
        for word in self.bad_words:
            if len(word) == 1 or self.reply[-(len(word) - 1) :] == word[:-1]:
                banned.add(word[-1])
        return banned

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with what may not come next at -inf (a copy, where anything is)."""
        banned = self.banned()
        if self.allowed is None and not banned and self.constraint is None:
            return logits
        out = logits.clone()
        if self.allowed is not None:
            keep = out[self.allowed]
            out.fill_(-torch.inf)
            out[self.allowed] = keep
        if banned:
            out[list(banned)] = -torch.inf
        if self.constraint is not None:
            self.constraint.mask(out)
        return out

    def noise(self, vocab: int, device: torch.device) -> torch.Tensor:
        """A draw's numbers ([vocab] exponential, as `torch.multinomial` draws them), from its
        generator: on a device of its own, seeded from it (as vLLM seeds a request's), the
        numbers made there, nothing copied."""
        if device.type != "cpu" and (
            self._device_generator is None or self._device_generator.device != device
        ):
            seed = int(torch.randint(2**62, (1,), generator=self.generator))
            self._device_generator = torch.Generator(device).manual_seed(seed)
        generator = self.generator if device.type == "cpu" else self._device_generator
        return torch.empty(vocab, device=device).exponential_(1, generator=generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] logits (masked as they may be) as what a draw reads: at its temperature,
        min-p and top-k (transformers' processors), softmax, then top-p. No value is read back."""
        scaled = logits / self.temperature
        for warp in self.warpers:
            scaled = warp(torch.empty(scaled.shape[0], 0, dtype=torch.long), scaled)
        probs = torch.softmax(scaled, dim=-1)
        return probs if self.top_p >= 1.0 else _top_p(probs, self.top_p, self.top_k)

    def pick(self, logits: torch.Tensor, noise: torch.Tensor | None = None) -> Choice:
        """`logits` [vocab], float32: the model's scores for the next token. `noise`: the
        numbers of its generator this pick's draw reads, where already drawn (`noise`)."""
        logits = logits.float()
        adjusted = self._masked(logits)
        if self.bias or (self.counts and (self.frequency_penalty or self.presence_penalty)):
            adjusted = adjusted.clone() if adjusted is logits else adjusted
            for token, bias in self.bias.items():
                adjusted[token] += bias
            if self.counts:
                ids = torch.tensor(list(self.counts))
                n = torch.tensor(list(self.counts.values()), dtype=adjusted.dtype)
                adjusted[ids] -= self.frequency_penalty * n + self.presence_penalty
        if self.repetition is not None and self.seen:
            adjusted = self.repetition(self.seen_ids, adjusted.unsqueeze(0))[0]
        adjusted = _at_the_limit(adjusted)
        if bool(torch.isneginf(adjusted).all()):
            raise InvalidRequest(
                "the request's constraints leave no token that may come next (its structured output, "
                "min_tokens, allowed_token_ids and bad_words together)"
            )
        if self.greedy:
            token = int(torch.argmax(adjusted))
        else:
            q = self.noise(len(adjusted), adjusted.device) if noise is None else noise
            token = int(_raced(self.probs(adjusted[None]), q[None])[0])
        self.took(token)
        if self.logprobs is None:
            return Choice(token)
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, self.logprobs) if self.logprobs else None
        return Choice(
            token,
            float(logprobs[token]),
            list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else [],
        )

    def took(self, token: int) -> None:
        """`token` is the reply's next: what the picks after it depend on."""
        self.counts[token] += 1
        if token not in self.seen:  # a step's work stays that of the distinct tokens, not the reply's length
            self.seen[token] = None
            self.seen_ids = torch.tensor([list(self.seen)], dtype=torch.long)
        self.reply.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)


def pick_together(samplers: list[TokenSampler], logits: torch.Tensor) -> list[Choice]:
    """Each request's choice from its row of `logits` [B, vocab]: what its own `pick` chooses.
    The rows read with bans at most (`plain`: the usual request, greedy or sampled) are picked
    for the batch at once: one argmax, the sampled rows drawn together where their settings are
    alike (each at its own generator's numbers), and one copy to the host, where a row at a
    time takes a handful of passes over the vocabulary and of copies to the host (on a GPU each
    a wait for the device); a row whose logits hold a NaN or +inf, or leave nothing unbanned,
    goes to its own `pick` (with the numbers it drew), which says what it does with them."""
    chosen: dict[int, int] = {}
    fast = [i for i, s in enumerate(samplers) if s.plain]
    noise: dict[int, torch.Tensor] = {}
    if fast:
        rows = (logits if len(fast) == len(samplers) else logits[fast]).float()
        bans = [samplers[i].banned() for i in fast]
        if any(bans):
            rows = rows.clone() if rows is logits else rows  # (the bans go in place)
            at = [(k, t) for k, banned in enumerate(bans) for t in banned]
            rows[[k for k, _ in at], [t for _, t in at]] = -torch.inf
        # A row's max is NaN where it holds one, +inf where it holds that, -inf where all is banned:
        # those rows go to their own pick. Else a greedy row's index is argmax's (the first of the max).
        top, picks = rows.max(-1)
        sampled = [k for k, i in enumerate(fast) if not samplers[i].greedy]
        if sampled:  # each row's numbers drawn now, its own pick reading them if it goes there
            vocab, device = rows.shape[-1], rows.device
            noise = {fast[k]: samplers[fast[k]].noise(vocab, device) for k in sampled}
            picks = picks.clone()
            for group in _alike([samplers[fast[k]] for k in sampled], sampled):
                first = samplers[fast[group[0]]]
                picks[group] = _raced(first.probs(rows[group]), torch.stack([noise[fast[k]] for k in group]))
        picks, ok = torch.stack([picks, torch.isfinite(top).long()]).tolist()
        chosen = {i: picks[k] for k, i in enumerate(fast) if ok[k]}
    # The rows' own picks first: one that refuses its request does so before the batch's rows
    # are taken (a batch that fails runs again a request at a time).
    own = {i: s.pick(logits[i], noise.get(i)) for i, s in enumerate(samplers) if i not in chosen}
    for i, token in chosen.items():
        samplers[i].took(token)
    return [Choice(chosen[i]) if i in chosen else own[i] for i in range(len(samplers))]


def _alike(samplers: list[TokenSampler], rows: list[int]) -> list[list[int]]:
    """`rows` grouped by what their samplers' draws depend on (`drawn_alike`), in order."""
    groups: dict[tuple[float, float, float, int], list[int]] = {}
    for s, k in zip(samplers, rows, strict=True):
        groups.setdefault(s.drawn_alike, []).append(k)
    return list(groups.values())


def _top_p(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """`probs` [n, vocab] with only each row's likeliest tokens until their sum reaches `top_p`
    (the first of them always), the rest at 0. After top-k (`top_k` > 0), only the k likeliest
    hold probability: those alone are sorted (at the real vocabulary, batch 8, on a CPU, 2.4 ms
    against 20 for the whole row's sort), the same tokens kept. A token outside the k that
    top-k kept for a tie at the k-th probability is kept where the k do not reach `top_p`, as
    the whole sort keeps it (where several such ties would cross `top_p`, even the whole sort's
    choice among them is its order of equal values)."""
    whole = not 0 < top_k < probs.shape[-1]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True) if whole else torch.topk(probs, top_k)
    mass = torch.cumsum(sorted_p, dim=-1)  # of each token and the likelier ones
    kept = sorted_p.masked_fill(mass - sorted_p >= top_p, 0.0)
    rest = probs if whole else probs * (mass[:, -1:] < top_p)  # (outside the k: 0 but for a tie)
    return rest.scatter(-1, order, kept)


def _raced(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Each row's token [n] of `probs` [n, vocab] (not necessarily summing to 1) at its
    exponential numbers `noise` [n, vocab]: the largest probability over its number, a draw in
    proportion to the probabilities (`torch.multinomial`'s own way for one sample, so never a
    token of probability 0), on the device, nothing read back."""
    return torch.argmax(probs / noise, dim=-1)


Warper = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _warpers(sampling: Sampling) -> list[Warper]:
    """min-p, then top-k, on temperature-scaled logits (vLLM's order): transformers' own."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper

    out: list[Warper] = []
    min_p = sampling.min_p or 0.0
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequest(f"min_p: {min_p} is not between 0 and 1")
    if min_p > 0.0:
        out.append(MinPLogitsWarper(min_p))
    top_k = sampling.top_k or 0
    if top_k < -1:
        raise InvalidRequest(f"top_k: {top_k} must be -1 or 0 (all tokens), or positive")
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k))
    return out


def _repetition(sampling: Sampling) -> Warper | None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalty = sampling.repetition_penalty or 1.0
    if not torch.tensor(penalty, dtype=torch.float32) > 0:  # 5e-324 is 0 in the logits' float32
        raise InvalidRequest(f"repetition_penalty: {penalty} must be above 0 (in float32)")
    return None if penalty == 1.0 else RepetitionPenaltyLogitsProcessor(penalty)


def _bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens, alone and after a space (as vLLM bans them: a word mid-sentence
    is usually its spaced form)."""
    if words and tokenizer is None:
        raise InvalidRequest("bad_words: this model's engine has no tokenizer to read them with")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return out


def _at_the_limit(logits: torch.Tensor) -> torch.Tensor:
    """Logits the adjustments pushed past float's range, as their limit: tokens at +inf (a
    vanishing repetition_penalty divides a positive logit) are the only ones that may come, all
    alike; a NaN may not come. Otherwise softmax makes NaNs of them all, and the draw a token
    the mask had forbidden. A token at -inf (masked) stays there."""
    if bool(torch.isfinite(logits[~torch.isneginf(logits)]).all()):
        return logits
    top = torch.isposinf(logits)
    if bool(top.any()):
        return torch.where(top, 0.0, -torch.inf)
    return torch.nan_to_num(logits, nan=-torch.inf)
