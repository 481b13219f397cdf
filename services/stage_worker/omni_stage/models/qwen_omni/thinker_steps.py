"""A Qwen-Omni thinker's forwards on its compute thread, a batch of its requests' next forwards
at a time (the part's `StepBatcher` runs `ThinkerSteps.run`): a prompt's prefill alone, the
prompts of text that queue together prefilled together (kv_batch.prefill_together, up to
`prefillBatchTokens` positions a forward: by default on CUDA only, where a prefill is
launch-bound; on a CPU it is compute-bound, and served there a batch gained nothing), decode
steps on the requests' own caches (restacked, kv_batch.decode_together) or on the slot table;
each step's token picked for the batch at once, and what the talker reads of its positions
fetched to the host. A request's cache (`ThinkerCache`) is the state they step on."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omni_pipeline.control import PromptLogprobs
from omni_stage.engines.kv_batch import by_length, decode_together, prefill_together
from omni_stage.engines.last_logits import last_logits
from omni_stage.engines.prompt_cache import MediaSpan, Sequence
from omni_stage.engines.reply import prompt_logprobs
from omni_stage.engines.sampling import Choice, TokenSampler, pick_together
from omni_stage.engines.slot_cache import SlotCache, SlotSteps
from omni_stage.models.qwen_omni.prefill import PrefillInputs
from omni_stage.models.qwen_omni.prompt import Prompt
from omni_stage.models.qwen_omni.slots import HoldsSlot


class Thinker(Protocol):
    """What the forwards read of their thinker (thinker.py's part), as its load left it."""

    device: torch.device
    model: Any
    tokenizer: Any
    prefills: PrefillInputs | None
    slots: SlotCache | None
    stepper: SlotSteps | None
    prefill_tokens: int

    @property
    def talker_layer(self) -> int: ...

    def slot_of(self, st: HoldsSlot) -> int: ...


class ThinkerSteps:
    """The forwards of a thinker `part`, reading its model, slot table and prefills' inputs as
    they are at each call (each load, a wake's included, builds them again)."""

    def __init__(self, part: Thinker) -> None:
        self.part = part

    def key(self, st: ThinkerCache, prompt: Prompt, sampler: TokenSampler) -> Hashable:
        """What a request's prefill may run with: a prompt of text alone on a new cache, with no
        prompt log probabilities, with the others like it (`run`: prefilled together); any other
        prompt alone (its media encoded in its forward, its kept sequence resumed)."""
        alone = (
            not self.part.prefill_tokens
            or prompt.features
            or prompt.embeds is not None
            or st.start
            or st.past is not None
            or st.ahead
            or sampler.prompt_logprobs is not None
        )
        return object() if alone else "prefill"

    def run(self, steps: list[NextForward]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """Each request's next token and what the talker reads of the positions its forward
        computed (a batch of one key: prefills, or decode steps)."""
        prefill = steps[0].st.rope_deltas is None
        if prefill and len(steps) > 1:
            return self._prefill_together(steps)
        if self.part.stepper is not None and not prefill:
            return self._decode_slots(steps)
        if len(steps) == 1:
            s = steps[0]
            return [self._step(s.st, s.ids, s.sampler, s.prompt)]
        return self._decode_together(steps)

    @torch.inference_mode()
    def _prefill_together(self, steps: list[NextForward]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """Prompts of text alone on new caches (`key`), in forwards of prompts of
        about the same length, each of `prefillBatchTokens` positions at most
        (kv_batch.by_length), their first tokens picked together. The requests' states are set
        last, each cache then its own or copied into its slot: a batch that fails (a request's
        constraints leaving no token to pick) runs again a prompt at a time, as prefills."""
        done: dict[int, Prefilled] = {}
        for group in by_length([int(s.prompt.ids.shape[1]) for s in steps], self.part.prefill_tokens):
            done |= zip(group, self._prefill_forward([steps[i].prompt for i in group]), strict=True)
        prefilled = [done[i] for i in range(len(steps))]
        choices = pick_together([s.sampler for s in steps], torch.stack([p.logits for p in prefilled]))
        for s, p in zip(steps, prefilled, strict=True):
            s.st.rope_deltas = p.rope_deltas
            if self.part.slots is not None:
                self.part.slots.put(self.part.slot_of(s.st), p.cache)
            else:
                s.st.past = p.cache
        return [(c, p.embeds, p.hidden) for c, p in zip(choices, prefilled, strict=True)]

    def _prefill_forward(self, prompts: list[Prompt]) -> list[Prefilled]:
        """Prompts of text alone in one forward (kv_batch.prefill_together)."""
        assert self.part.prefills is not None
        pres = [self.part.prefills.of(prompt, 0, {}) for prompt in prompts]
        assert all(p.inputs.keys() == {"input_ids"} for p in pres), "a prompt of text alone"
        out, caches = prefill_together(
            self.part.model,
            [p.positions for p in pres],
            [p.prompt.ids for p in pres],
            head=self.part.model.get_output_embeddings(),
            output_hidden_states=True,
        )
        first, rest = _on_host(out.hidden_states[0], out.hidden_states[self.part.talker_layer])
        lengths = [int(p.prompt.ids.shape[1]) for p in pres]
        return [
            Prefilled(
                out.logits[i, -1],
                first[i : i + 1, :n].contiguous(),
                rest[i : i + 1, :n].contiguous(),
                pre.rope_deltas,
                cache,
            )
            for i, (n, pre, cache) in enumerate(zip(lengths, pres, caches, strict=True))
        ]

    @torch.inference_mode()
    def _decode_together(self, steps: list[NextForward]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        out, caches = decode_together(
            self.part.model,
            [s.st.past for s in steps],
            [s.st.next_positions(self.part.device) for s in steps],
            input_ids=torch.cat([s.ids for s in steps]),
            output_hidden_states=True,
        )
        for s, cache in zip(steps, caches, strict=True):
            s.st.past = cache
        reads = (out.logits, out.hidden_states[0], out.hidden_states[self.part.talker_layer])
        return self._picked(steps, reads, list(range(len(steps))))

    @torch.inference_mode()
    def _decode_slots(self, steps: list[NextForward]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """A decode step of requests at their slots, their position ids and input embeddings
        built for the batch at once."""
        assert self.part.slots is not None and self.part.stepper is not None
        slots = [self.part.slot_of(s.st) for s in steps]
        embeds = self.part.model.get_input_embeddings()(torch.cat([s.ids for s in steps]))  # [B, 1, H]
        at = torch.tensor([self.part.slots.lengths[slot] for slot in slots], device=self.part.device)
        deltas = torch.cat([s.st.rope_deltas for s in steps]).view(-1)  # (each [1, 1]; Qwen3's float)
        positions = (at + deltas).long().view(1, -1, 1).expand(3, -1, -1)
        out, rows = self.part.stepper.step(slots, positions, embeds)
        return self._picked(steps, out, rows)

    def _picked(
        self, steps: list[NextForward], reads: tuple[torch.Tensor, ...], rows: list[int]
    ) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """Each step's token from its row of a batched forward's logits, and what the talker
        reads of its position ([1, 1, H] each), each fetched for the batch at once. `reads`:
        the logits, the input embeddings and the talker's layer's hidden states."""
        logits, embeds, hidden = reads
        choices = pick_together([s.sampler for s in steps], logits[rows, -1])
        first, last = (t.contiguous() for t in _on_host(embeds[rows], hidden[rows]))
        return [(c, first[i : i + 1], last[i : i + 1]) for i, c in enumerate(choices)]

    @torch.inference_mode()
    def _step(
        self,
        st: ThinkerCache,
        ids: torch.Tensor,
        sampler: TokenSampler,
        prompt: Prompt,
    ) -> tuple[Choice, torch.Tensor, torch.Tensor]:
        m = self.part.model
        past = st.past
        prefill = st.rope_deltas is None
        if prefill:  # the prompt (past what a kept sequence holds): its positions, its media
            assert self.part.prefills is not None
            pre = self.part.prefills.of(prompt, st.start, st.ahead)
            prompt, ids, positions, inputs = pre.prompt, pre.prompt.ids, pre.positions, pre.inputs
            st.rope_deltas, st.ahead = pre.rope_deltas, {}
        else:
            positions, inputs = st.next_positions(self.part.device), {"input_ids": ids}
        # A prompt's logits at its last position alone, unless its log probabilities are asked.
        head = m.get_output_embeddings() if prefill and sampler.prompt_logprobs is None else None
        with last_logits(head):
            if self.part.slots is not None:  # a prefill: the slot holds its sequence from now on
                out = self.part.slots.prefill(
                    m, self.part.slot_of(st), past, positions, output_hidden_states=True, **inputs
                )
                st.past = None
            else:
                out = m(
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                    output_hidden_states=True,
                    **inputs,
                )
                st.past = out.past_key_values
        if prefill and sampler.prompt_logprobs is not None:
            st.prompt_logprobs = prompt_logprobs(
                self.part.tokenizer, ids[0].tolist(), out.logits[0], sampler.prompt_logprobs
            )
        [choice] = pick_together([sampler], out.logits[:1, -1])  # (one wait for the device, not a few)
        # Layer 0 is the input embedding, the last the final (normed) layer: what the talker reads.
        embeds = out.hidden_states[0].float().cpu()  # (on a CPU, no copy: not joined with the other)
        if prefill and prompt.media_mask is not None:
            # but not the media's features: zeros there, as the reference hands it
            embeds = embeds.masked_fill(prompt.media_mask.cpu()[..., None], 0.0)
        return choice, embeds, out.hidden_states[self.part.talker_layer].float().cpu()


def _on_host(embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the talker reads of a forward's positions (the input embeddings and the talker's
    layer, [B, n, H] each), in float32 on the host: one copy for both."""
    both = torch.cat([embeds, hidden], dim=-1).float().cpu()
    first, rest = both.split(embeds.shape[-1], dim=-1)
    return first, rest


@dataclass(slots=True)
class ThinkerCache(HoldsSlot):
    """One request's KV cache (its own, or its slot's), and the offset of its M-RoPE positions
    (set by the prefill); with a `prompt_cache_key`, its sequence as the cache holds it
    (`Sequence`'s parts)."""

    past: Any = None
    rope_deltas: torch.Tensor | None = None
    prompt_logprobs: PromptLogprobs | None = None
    start: int = 0
    """Positions a kept sequence held: the prefill computes those after."""
    key: str | None = None
    """The conversation's `prompt_cache_key`, where its sequence is kept."""
    ahead: dict[bytes, torch.Tensor] = field(default_factory=dict)
    """Its live session's audio windows encoded as they arrived, by digest, until the prefill."""
    kept: bool = False
    tokens: list[int] = field(default_factory=list)
    media: list[MediaSpan] = field(default_factory=list)
    embeds: list[torch.Tensor] = field(default_factory=list)
    """What the talker reads of each position: its input embedding (zeros at media), [n, H]..."""
    hidden: list[torch.Tensor] = field(default_factory=list)
    """...and its hidden state at the talker's layer, [n, H] (kept only with a key)."""

    def next_positions(self, device: torch.device) -> torch.Tensor:
        """The next position's 3-D ids: the same on all three axes, offset as the prompt's were."""
        at = self.past.get_seq_length() + self.rope_deltas
        return (torch.arange(1, device=device) + at).view(1, 1, -1).expand(3, 1, -1)

    def resume(self, seq: Sequence) -> int:
        """Start on the conversation's kept sequence, as far as this prompt shares it: that
        cache, cut to the shared positions, and what the talker reads of them. Returns how many
        positions it holds (0: none shared, nothing taken)."""
        if not (n := seq.shared(self.tokens, self.media)):
            return 0
        seq.cut(n)
        self.past, self.start = seq.past, n
        self.embeds, self.hidden = [seq.rows["embeds"].float()], [seq.rows["hidden"].float()]
        return n

    def left(self, dtype: torch.dtype) -> Sequence | None:
        """The sequence to keep for the conversation's next turn, once (None: no key, kept
        already, or cut short before its prefill's rows came back). The last token sampled is
        not fed: not held."""
        if self.key is None or self.kept or self.past is None or not self.embeds:
            return None
        self.kept = True
        rows = {  # in the model's dtype: what they were computed in, half the memory in bf16
            "embeds": torch.cat(self.embeds).to(dtype),
            "hidden": torch.cat(self.hidden).to(dtype),
        }
        return Sequence.left(self.tokens, self.past, self.media, rows)


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prompt prefilled with others: its last position's logits, what the talker reads of
    its positions ([1, n, H] each, on the host), its M-RoPE offset and its cache."""

    logits: torch.Tensor
    embeds: torch.Tensor
    hidden: torch.Tensor
    rope_deltas: torch.Tensor
    cache: Any


@dataclass(frozen=True, slots=True)
class NextForward:
    """One request's next forward: its prompt, or its last token."""

    st: ThinkerCache
    ids: torch.Tensor
    sampler: TokenSampler
    prompt: Prompt
