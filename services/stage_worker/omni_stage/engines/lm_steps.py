"""A `transformers` engine's forwards on its compute thread, a batch of its requests' next
forwards at a time (the engine's `StepBatcher` runs `LMSteps.run`): a prompt or a window of
embeddings alone, the prompts of token ids that queue together on new caches in forwards of
about one length (`prefillBatchTokens`, kv_batch.prefill_together), the one-token decode steps
together on their restacked caches (kv_batch.decode_together); each batch's tokens picked at
once. A request's decoding (`Decoding`) is the state they step on."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omni_pipeline.control import PromptLogprobs
from omni_stage.engines.kv_batch import by_length, decode_together, prefill_together
from omni_stage.engines.last_logits import last_logits
from omni_stage.engines.reply import ReplyText, prompt_logprobs
from omni_stage.engines.sampling import Choice, TokenSampler, pick_together
from omni_stage.engines.tools import ToolPlan


class LM(Protocol):
    """What the forwards read of their engine (transformers_lm.py's), as its load left it."""

    model: Any
    tokenizer: Any
    device: torch.device
    return_hidden: bool
    prefill_tokens: int


@dataclass(slots=True)
class Decoding:
    """One request's decoding, across its calls: the cache, the token sampled last and not yet
    fed (the next step, or call, feeds it), and what reads the request's sampling fields (set
    on its first call)."""

    past: Any = None
    pending: int | None = None
    sampler: TokenSampler | None = None
    prompt_logprobs: PromptLogprobs | None = None
    tools: ToolPlan | None = None
    reply: ReplyText | None = None
    tokens: list[int] = field(default_factory=list)
    """A client request's prompt and the tokens sampled since: its sequence, as far as the cache
    holds it (what `PromptCaches.keep` keeps)."""
    key: str | None = None
    """A client request's `prompt_cache_key`, where its sequence is kept."""
    kept: bool = False


@dataclass(frozen=True, slots=True)
class LMStep:
    """One request's next forward: token ids or embeddings, on top of its cache."""

    st: Decoding
    ids: torch.Tensor | None
    embeds: torch.Tensor | None
    sampler: TokenSampler

    @property
    def is_decode(self) -> bool:
        """One token on a cache: a step that batches with other requests' decode steps."""
        return self.ids is not None and self.ids.shape[1] == 1 and self.st.past is not None


class LMSteps:
    """The forwards of engine `lm`, reading its model as it is at each call (a wake loads it
    again)."""

    def __init__(self, lm: LM) -> None:
        self.lm = lm

    def key(self, step: LMStep) -> Hashable:
        """What a step may run with: one-token decode steps together; prompts of token ids on
        new caches, with no prompt log probabilities, together (`prefillBatchTokens`); any
        other forward (a window of embeddings, a kept sequence resumed) alone."""
        if step.is_decode:
            return "decode"
        if (
            self.lm.prefill_tokens
            and step.ids is not None
            and step.st.past is None
            and step.sampler.prompt_logprobs is None
        ):
            return "prefill"
        return object()

    def run(self, steps: list[LMStep]) -> list[tuple[Choice, torch.Tensor]]:
        """Each request's next token and, with `returnHiddenStates`, the last layer's hidden
        state that drew it (a batch of one key: prefills, or decode steps)."""
        if len(steps) == 1:
            return [self._step(steps[0])]
        if steps[0].st.past is None:
            return self._prefill_together(steps)
        return self._decode_together(steps)

    @torch.inference_mode()
    def _prefill_together(self, steps: list[LMStep]) -> list[tuple[Choice, torch.Tensor]]:
        """Prompts of token ids on new caches (`key`), in forwards of prompts of about one
        length (kv_batch.by_length), their first tokens picked together. The caches are set
        last: a batch that fails (a request's constraints leaving no token to pick) runs again
        a prompt at a time."""
        lm = self.lm
        ids: list[torch.Tensor] = [s.ids for s in steps]  # type: ignore[misc]
        rows: dict[int, tuple[torch.Tensor, torch.Tensor | None, Any]] = {}
        for group in by_length([int(x.shape[1]) for x in ids], lm.prefill_tokens):
            prompts = [ids[i] for i in group]
            positions = [torch.arange(x.shape[1], device=lm.device)[None] for x in prompts]
            out, caches = prefill_together(
                lm.model,
                positions,
                prompts,
                head=lm.model.get_output_embeddings(),
                output_hidden_states=lm.return_hidden,
            )
            for row, (i, cache) in enumerate(zip(group, caches, strict=True)):
                last = int(ids[i].shape[1]) - 1
                hidden = out.hidden_states[-1][row, last : last + 1] if lm.return_hidden else None
                rows[i] = (out.logits[row, -1], hidden, cache)
        done = [rows[i] for i in range(len(steps))]
        choices = pick_together([s.sampler for s in steps], torch.stack([logits for logits, _, _ in done]))
        for s, (_, _, cache) in zip(steps, done, strict=True):
            s.st.past = cache
        if not lm.return_hidden:
            return [(c, torch.empty(0)) for c in choices]
        hidden = torch.cat([h for _, h, _ in done]).float().cpu()  # type: ignore[misc]
        return [(c, hidden[i : i + 1]) for i, c in enumerate(choices)]

    @torch.inference_mode()
    def _step(self, s: LMStep) -> tuple[Choice, torch.Tensor]:
        lm = self.lm
        fed = s.ids if s.ids is not None else s.embeds
        assert fed is not None
        scored = s.sampler.prompt_logprobs is not None and s.st.past is None and s.ids is not None
        # More than one position (a prompt, a window): the logits at the last alone, unless the
        # prompt's log probabilities read them all.
        head = None if scored or fed.shape[1] == 1 else lm.model.get_output_embeddings()
        with last_logits(head):
            out = lm.model(
                input_ids=s.ids,
                inputs_embeds=s.embeds,
                past_key_values=s.st.past,
                use_cache=True,
                output_hidden_states=lm.return_hidden,
            )
        if scored:
            ids = s.ids[0].tolist()  # type: ignore[index]
            s.st.prompt_logprobs = prompt_logprobs(
                lm.tokenizer, ids, out.logits[0], s.sampler.prompt_logprobs
            )
        s.st.past = out.past_key_values
        hidden = out.hidden_states[-1][0, -1:].float().cpu() if lm.return_hidden else torch.empty(0)
        [choice] = pick_together([s.sampler], out.logits[:1, -1])  # (one wait for the device, not a few)
        return choice, hidden

    @torch.inference_mode()
    def _decode_together(self, steps: list[LMStep]) -> list[tuple[Choice, torch.Tensor]]:
        lm = self.lm
        caches = [s.st.past for s in steps]
        out, caches = decode_together(
            lm.model,
            caches,
            [torch.tensor([[c.get_seq_length()]], device=lm.device) for c in caches],
            input_ids=torch.cat([s.ids for s in steps if s.ids is not None]),
            output_hidden_states=lm.return_hidden,
        )
        for s, cache in zip(steps, caches, strict=True):
            s.st.past = cache
        choices = pick_together([s.sampler for s in steps], out.logits[:, -1])
        hidden = out.hidden_states[-1][:, -1:].float().cpu() if lm.return_hidden else None
        return [(c, torch.empty(0) if hidden is None else hidden[row]) for row, c in enumerate(choices)]
