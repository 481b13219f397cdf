"""The Qwen-Omni thinker: the chat template (media in), decoding with a KV cache, batched across
requests (its forwards: thinker_steps.py); each unit carries what a talker reads (the input
embedding and last hidden state).

Each request's cache is its own `DynamicCache`, restacked for a batched step (kv_batch.py), or,
with `fixedSteps` (`cudaGraphs` on CUDA: its decode steps replayed as graphs), a slot of a table
allocated once at `maxModelLen` positions a slot (slot_cache.py, fixed_steps.py;
docs/architecture.md says when which).

A request that names a `prompt_cache_key` keeps its sequence when it ends, with what the talker
reads of each position (the talker reads the whole prompt's, the reused positions' included);
the key's next request prefills only the positions its prompt adds (prompt_cache.py), its
M-RoPE positions those of the whole prompt. Prompts of text that queue together are
prefilled together (`prefillBatchTokens`, thinker_steps.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch

from omni_pipeline.payloads import ThinkerStep
from omni_pipeline.sampling import params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.prompt_cache import Sequence
from omni_stage.engines.prompts import check_context
from omni_stage.engines.reply import ReplyText, token_logprobs
from omni_stage.engines.sampling import HONOURED, TokenSampler
from omni_stage.engines.structured import JsonGrammars
from omni_stage.models.qwen_omni.prefill import PrefillInputs
from omni_stage.models.qwen_omni.prompt import MediaEmbeds, Prompt, Prompts
from omni_stage.models.qwen_omni.slots import SlotPart
from omni_stage.models.qwen_omni.thinker_steps import NextForward, ThinkerCache, ThinkerSteps
from omni_stage.segments import EngineOutput


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
        self.steps = ThinkerSteps(self)
        self.batcher = StepBatcher(self.steps.run, self._compute, self.max_batch)
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
        prompt = await self._build(self.prompts.build, request, embeds, call.sampling)
        ids = prompt.ids
        st = call.kept(ThinkerCache)
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
            kept = await self.prompt_caches.take(st.key)  # on the loop, as every use of the caches
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
        with self._keeping_if_cut(st):  # a barge-in: what it made is kept
            for s in range(budget):
                # Decode steps of concurrent requests run together, and prompts alike (ThinkerSteps.key).
                step = NextForward(st, feed, sampler, prompt)
                key = "decode" if s else self.steps.key(st, prompt, sampler)
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

    def _reuse(self, call: EngineCall, st: ThinkerCache, seq: Sequence | None, prompt: Prompt) -> None:
        """The request resumed from its conversation's kept sequence as far as its prompt
        shares it (ThinkerCache.resume), counted. On the compute thread (media digests read features)."""
        assert self.prompts is not None
        st.media = self.prompts.media_spans(prompt)
        if seq is not None and (n := st.resume(seq)):
            call.state.cached_tokens = n
            self.prompt_caches.reused_tokens += n

    def _keep(self, st: ThinkerCache) -> None:
        if st.slot is not None and st.key is not None and not st.kept:
            st.past = self._held(st)  # the slot's positions, copied out
        if (left := st.left(self.dtype)) is not None:
            assert st.key is not None
            self.prompt_caches.keep(st.key, left)

    def _prompt_extras(self, prompt: Prompt) -> ThinkerStep:
        """What else of the prompt the talker reads, with the first token."""
        return ThinkerStep()


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
