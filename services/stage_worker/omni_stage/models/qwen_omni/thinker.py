"""The Qwen-Omni thinker: the chat template (media in), decoding with a KV cache, batched across
requests; each unit carries what a talker reads (the input embedding and last hidden state).

Each request's cache is its own `DynamicCache`, restacked for a batched step (kv_batch.py), or,
with `fixedSteps` (`cudaGraphs` on CUDA: its decode steps replayed as graphs), a slot of a table
allocated once at `maxModelLen` positions a slot (slot_cache.py, fixed_steps.py;
docs/architecture.md says when which).

A request that names a `prompt_cache_key` keeps its sequence when it ends, with what the talker
reads of each position (the talker reads the whole prompt's, the reused positions' included);
the key's next request prefills only the positions its prompt adds (prompt_cache.py), its
M-RoPE positions those of the whole prompt.

Prompts of text alone that queue together are prefilled together (kv_batch.py), in forwards
of up to `prefillBatchTokens` positions, padding included (by default on CUDA only, where a
prefill is launch-bound: on a CPU it is compute-bound, and a batch only makes the first prompt
wait for the last); a prompt with media, a kept sequence or prompt log probabilities, alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_pipeline.control import PromptLogprobs
from omni_pipeline.payloads import ThinkerStep
from omni_pipeline.sampling import params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.kv_batch import by_length, decode_together, prefill_together
from omni_stage.engines.prompt_cache import MediaSpan, Sequence
from omni_stage.engines.prompts import check_context
from omni_stage.engines.reply import ReplyText, prompt_logprobs, token_logprobs
from omni_stage.engines.sampling import HONOURED, Choice, TokenSampler, pick_together
from omni_stage.engines.structured import JsonGrammars
from omni_stage.models.qwen_omni.prefill import PrefillInputs
from omni_stage.models.qwen_omni.prompt import MediaEmbeds, Prompt, Prompts
from omni_stage.models.qwen_omni.slots import HoldsSlot, SlotPart
from omni_stage.segments import EngineOutput

PREFILL_BATCH_TOKENS: Final = 2048
"""`prefillBatchTokens` on CUDA: prompt positions one batched prefill computes at most."""


class Thinker(SlotPart):
    """Reads the client's messages, their audio, images and videos included (see `Prompt`)."""

    part = "thinker"
    accepts = frozenset({"text", "image", "audio"})
    honours = HONOURED | params("mm_processor_kwargs")
    prompts_class = Prompts
    prefill_class = PrefillInputs
    sends_reply_hidden = True
    """Whether the talker reads each reply token's hidden state, or only its embedding."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.tokenizer: Any = None
        self.prompts: Prompts | None = None
        self.prefills: PrefillInputs | None = None
        self.eos: set[int] = set()
        self.grammars: JsonGrammars | None = None
        self.prefill_tokens = self.args.get(
            "prefillBatchTokens", PREFILL_BATCH_TOKENS if self.device.type == "cuda" else 0
        )
        """Prompt positions (padding included) one batched prefill computes at most; 0: alone."""
        if type(self.prefill_tokens) is not int or self.prefill_tokens < 0:
            raise EngineError(
                f"stage '{stage.name}': engine.args.prefillBatchTokens must be a whole number, 0 or "
                f"more, got {self.prefill_tokens!r}"
            )
        self.batcher = StepBatcher(self._steps, self._compute, self.max_batch)
        self.prompt_caches = self._kept_conversations()

    @property
    def vocab_size(self) -> int:
        return int(self.config.thinker_config.text_config.vocab_size)

    @property
    def talker_layer(self) -> int:
        """The layer whose hidden states the talker reads (-1: the last, normed)."""
        return -1

    @property
    def context(self) -> int:
        """The positions a request's prompt and reply may take: the model's, or `maxModelLen`."""
        model = int(self.config.thinker_config.text_config.max_position_embeddings)
        return model if self.max_model_len is None else min(model, self.max_model_len)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration, self.config.thinker_config

    def _load(self) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        super()._load()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.prompts = self.prompts_class(
            self.path, self.tokenizer, self.config.thinker_config, self.device, self.dtype
        )
        self.accepts = self.prompts.accepts
        eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if "response_format" in self.honours:
            self.grammars = JsonGrammars(self.tokenizer, self.vocab_size, sorted(self.eos))
        self._hear_ahead(self.prompts, lambda: self.model.audio_tower)
        self.prefills = self.prefill_class(
            self.model, self.prompts, self.audio_ahead, self.device, self.dtype, self.stage.name
        )
        if self.fixed_steps:  # each step's input embeddings in, what the talker reads out
            text = self.config.thinker_config.text_config
            reads = StepReads(self.model, self.talker_layer)
            self._build_slots(text, reads, text.hidden_size, 3, self.context)

    def prompt_tokenizer(self) -> tuple[Any, int] | None:
        return self.tokenizer, self.context

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request")
        if request is None:
            raise EngineError(f"stage '{self.stage.name}': the thinker reads the client request")
        assert self.prompts is not None
        # An encoder stage's outputs, where one ran on this request's media.
        embeds = next((e for p in call.inputs.values() if (e := MediaEmbeds.from_payload(p))), None)
        prompt = await self._run(self.prompts.build, request, embeds, call.sampling)
        ids = prompt.ids
        st = call.kept(_Cache)
        call.state.prompt_tokens = int(ids.shape[1])
        st.tokens = ids[0].tolist()
        key = call.sampling.prompt_cache_key
        if key is not None and self.audio_ahead is not None and "input_features" in prompt.features:
            st.ahead = await self.audio_ahead.take(str(key))  # (a text turn leaves the audio coming)
        keeping = (
            key is not None and self.prompt_caches.capacity > 0 and call.sampling.prompt_logprobs is None
        )
        if keeping:
            st.key = str(key)
            kept = self.prompt_caches.take(st.key)  # on the loop, as every use of the caches
            await self._run(self._reuse, call, st, kept, prompt)
        budget = call.sampling.max_tokens or 64
        check_context(int(ids.shape[1]), budget, self.context)
        # Off the compute thread, whose forwards other requests wait for (a grammar compiles).
        sampler = await asyncio.to_thread(
            lambda: TokenSampler(
                call.sampling,
                self.vocab_size,
                self.grammars,
                eos=frozenset(self.eos),
                prompt=ids[0].tolist(),
                tokenizer=self.tokenizer,
            )
        )
        text = ReplyText.for_request(self.tokenizer, call.sampling)
        feed = ids
        with self._keeping_if_cut(lambda: self._keep(st)):  # a barge-in: what it made is kept
            for s in range(budget):
                # Decode steps of concurrent requests run together, and prompts alike (`_prefill_key`).
                step = _ThinkerStep(st, feed, sampler, prompt)
                key = "decode" if s else self._prefill_key(st, prompt, sampler)
                choice, embeds, hidden = await self.batcher.submit(key, step)
                if st.key is not None:
                    st.embeds.append(embeds[0])
                    st.hidden.append(hidden[0])
                if s == 0:
                    call.state.prompt_logprobs = st.prompt_logprobs
                    if st.start:  # the talker reads the whole prompt's: the reused positions' first
                        embeds, hidden = torch.cat(st.embeds)[None], torch.cat(st.hidden)[None]
                tok = choice.token
                st.tokens.append(tok)
                data = ThinkerStep(token_ids=torch.tensor([tok]))
                if s == 0:  # [1, P, ...]: the prompt is one unit's worth
                    data.update(self._prompt_extras(prompt), prompt_embeds=embeds, prompt_hidden=hidden)
                else:  # [1, hidden]: the position that consumed token s - 1
                    data["reply_embeds"] = embeds[0]
                    if self.sends_reply_hidden:
                        data["reply_hidden"] = hidden[0]
                ended = sampler.ends(tok)
                delta, stopped = text.add(
                    None if ended and not text.include_stop else tok, last=ended or s == budget - 1
                )
                done = ended or stopped
                logprobs = [] if ended else token_logprobs(self.tokenizer, choice)
                if done or s == budget - 1:  # complete: kept for its next turn, its slot given back
                    self._keep(st)
                    self._give_back(st)
                yield EngineOutput(
                    units=1, text=delta, data=data, finish_reason="stop" if done else None, logprobs=logprobs
                )
                if done:
                    return
                feed = torch.tensor([[tok]], device=self.device)
        call.state.finish_reason = "length"

    def _reuse(self, call: EngineCall, st: _Cache, seq: Sequence | None, prompt: Prompt) -> None:
        """The request resumed from its conversation's kept sequence as far as its prompt
        shares it (_Cache.resume), counted. On the compute thread (media digests read features)."""
        assert self.prompts is not None
        st.media = self.prompts.media_spans(prompt)
        if seq is not None and (n := st.resume(seq)):
            call.state.cached_tokens = n
            self.prompt_caches.reused_tokens += n

    def _keep(self, st: _Cache) -> None:
        if st.slot is not None and st.key is not None and not st.kept:
            st.past = self._held(st)  # the slot's positions, copied out
        if (left := st.left(self.dtype)) is not None:
            assert st.key is not None
            self.prompt_caches.keep(st.key, left)

    def _prompt_extras(self, prompt: Prompt) -> ThinkerStep:
        """What else of the prompt the talker reads, with the first token."""
        return ThinkerStep()

    def _prefill_key(self, st: _Cache, prompt: Prompt, sampler: TokenSampler) -> Hashable:
        """What a request's prefill may run with: a prompt of text alone on a new cache, with no
        prompt log probabilities, with the others like it (`_prefill_together`); any other
        prompt alone (its media encoded in its forward, its kept sequence resumed)."""
        alone = (
            not self.prefill_tokens
            or prompt.features
            or prompt.embeds is not None
            or st.start
            or st.past is not None
            or st.ahead
            or sampler.prompt_logprobs is not None
        )
        return object() if alone else "prefill"

    def _steps(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        prefill = steps[0].st.rope_deltas is None
        if prefill and len(steps) > 1:
            return self._prefill_together(steps)
        if self.stepper is not None and not prefill:
            return self._decode_slots(steps)
        if len(steps) == 1:
            s = steps[0]
            return [self._step(s.st, s.ids, s.sampler, s.prompt)]
        return self._decode_together(steps)

    @torch.inference_mode()
    def _prefill_together(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """Prompts of text alone on new caches (`_prefill_key`), in forwards of prompts of
        about the same length, each of `prefillBatchTokens` positions at most
        (kv_batch.by_length), their first tokens picked together. The requests' states are set
        last, each cache then its own or copied into its slot: a batch that fails (a request's
        constraints leaving no token to pick) runs again a prompt at a time, as prefills."""
        done: dict[int, _Prefilled] = {}
        for group in by_length([int(s.prompt.ids.shape[1]) for s in steps], self.prefill_tokens):
            done |= zip(group, self._prefill_forward([steps[i].prompt for i in group]), strict=True)
        prefilled = [done[i] for i in range(len(steps))]
        choices = pick_together([s.sampler for s in steps], torch.stack([p.logits for p in prefilled]))
        for s, p in zip(steps, prefilled, strict=True):
            s.st.rope_deltas = p.rope_deltas
            if self.slots is not None:
                self.slots.put(self._slot(s.st), p.cache)
            else:
                s.st.past = p.cache
        return [(c, p.embeds, p.hidden) for c, p in zip(choices, prefilled, strict=True)]

    def _prefill_forward(self, prompts: list[Prompt]) -> list[_Prefilled]:
        """Prompts of text alone in one forward (kv_batch.prefill_together)."""
        assert self.prefills is not None
        pres = [self.prefills.of(prompt, 0, {}) for prompt in prompts]
        assert all(p.inputs.keys() == {"input_ids"} for p in pres), "a prompt of text alone"
        out, caches = prefill_together(
            self.model, [p.positions for p in pres], [p.prompt.ids for p in pres], output_hidden_states=True
        )
        embeds, hidden = out.hidden_states[0], out.hidden_states[self.talker_layer]
        both = torch.cat([embeds, hidden], dim=-1).float().cpu()  # (one copy to the host)
        first, rest = both.split(embeds.shape[-1], dim=-1)
        lengths = [int(p.prompt.ids.shape[1]) for p in pres]
        return [
            _Prefilled(
                out.logits[i, n - 1],
                first[i : i + 1, :n].contiguous(),
                rest[i : i + 1, :n].contiguous(),
                pre.rope_deltas,
                cache,
            )
            for i, (n, pre, cache) in enumerate(zip(lengths, pres, caches, strict=True))
        ]

    @torch.inference_mode()
    def _decode_together(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        out, caches = decode_together(
            self.model,
            [s.st.past for s in steps],
            [s.st.next_positions(self.device) for s in steps],
            input_ids=torch.cat([s.ids for s in steps]),
            output_hidden_states=True,
        )
        for s, cache in zip(steps, caches, strict=True):
            s.st.past = cache
        reads = (out.logits, out.hidden_states[0], out.hidden_states[self.talker_layer])
        return self._picked(steps, reads, list(range(len(steps))))

    @torch.inference_mode()
    def _decode_slots(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """A decode step of requests at their slots, their position ids and input embeddings
        built for the batch at once."""
        assert self.slots is not None and self.stepper is not None
        slots = [self._slot(s.st) for s in steps]
        embeds = self.model.get_input_embeddings()(torch.cat([s.ids for s in steps]))  # [B, 1, H]
        at = torch.tensor([self.slots.lengths[slot] for slot in slots], device=self.device)
        deltas = torch.cat([s.st.rope_deltas for s in steps]).view(-1)  # (each [1, 1]; Qwen3's float)
        positions = (at + deltas).long().view(1, -1, 1).expand(3, -1, -1)
        out, rows = self.stepper.step(slots, positions, embeds)
        return self._picked(steps, out, rows)

    def _picked(
        self, steps: list[_ThinkerStep], reads: tuple[torch.Tensor, ...], rows: list[int]
    ) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        """Each step's token from its row of a batched forward's logits, and what the talker
        reads of its position ([1, 1, H] each), each fetched for the batch at once. `reads`:
        the logits, the input embeddings and the talker's layer's hidden states."""
        logits, embeds, hidden = reads
        choices = pick_together([s.sampler for s in steps], logits[rows, -1])
        both = torch.cat([embeds[rows], hidden[rows]], dim=-1).float().cpu()  # (one copy to the host)
        first, last = (t.contiguous() for t in both.split(embeds.shape[-1], dim=-1))
        return [(c, first[i : i + 1], last[i : i + 1]) for i, c in enumerate(choices)]

    @torch.inference_mode()
    def _step(
        self,
        st: _Cache,
        ids: torch.Tensor,
        sampler: TokenSampler,
        prompt: Prompt,
    ) -> tuple[Choice, torch.Tensor, torch.Tensor]:
        m = self.model
        past = st.past
        prefill = st.rope_deltas is None
        if prefill:  # the prompt (past what a kept sequence holds): its positions, its media
            assert self.prefills is not None
            pre = self.prefills.of(prompt, st.start, st.ahead)
            prompt, ids, positions, inputs = pre.prompt, pre.prompt.ids, pre.positions, pre.inputs
            st.rope_deltas, st.ahead = pre.rope_deltas, {}
        else:
            positions, inputs = st.next_positions(self.device), {"input_ids": ids}
        if self.slots is not None:  # a prefill: the slot holds its sequence from now on
            out = self.slots.prefill(m, self._slot(st), past, positions, output_hidden_states=True, **inputs)
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
                self.tokenizer, ids[0].tolist(), out.logits[0], sampler.prompt_logprobs
            )
        [choice] = pick_together([sampler], out.logits[:1, -1])  # (one wait for the device, not a few)
        # Layer 0 is the input embedding, the last the final (normed) layer: what the talker reads.
        embeds = out.hidden_states[0].float().cpu()
        if prefill and prompt.media_mask is not None:
            # but not the media's features: zeros there, as the reference hands it
            embeds = embeds.masked_fill(prompt.media_mask.cpu()[..., None], 0.0)
        return choice, embeds, out.hidden_states[self.talker_layer].float().cpu()


class StepReads(torch.nn.Module):
    """The thinker's forward as its decode steps on the slot table run it, giving back only
    what the stage reads of a step: the logits, the input embeddings and the talker's layer's
    hidden states. A captured step's outputs are copied out at each replay (fixed_steps.py),
    and the model's own are every layer's hidden states."""

    def __init__(self, model: torch.nn.Module, layer: int) -> None:
        super().__init__()
        self.model = model
        self.layer = layer
        self.config = model.config  # (what FixedSteps reads: the attention's implementation)

    def forward(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model(**inputs, output_hidden_states=True)
        return out.logits, out.hidden_states[0], out.hidden_states[self.layer]


@dataclass(slots=True)
class _Cache(HoldsSlot):
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
class _Prefilled:
    """A prompt prefilled with others: its last position's logits, what the talker reads of
    its positions ([1, n, H] each, on the host), its M-RoPE offset and its cache."""

    logits: torch.Tensor
    embeds: torch.Tensor
    hidden: torch.Tensor
    rope_deltas: torch.Tensor
    cache: Any


@dataclass(frozen=True, slots=True)
class _ThinkerStep:
    """One request's next forward: its prompt, or its last token."""

    st: _Cache
    ids: torch.Tensor
    sampler: TokenSampler
    prompt: Prompt
