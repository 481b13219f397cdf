"""A Hugging Face causal LM run step by step, for AR stages (thinker, talker) on CPU or GPU.

Each forward step runs on the engine's compute thread, so the event loop keeps serving NATS
while torch computes; cancelling the request's task stops the loop after the current step. The
KV cache lives in the request's own state (`call.kept`), so a windowed consumer (a talker fed 8 thinker
states at a time) continues one sequence across calls instead of starting over. The one-token
decode steps of concurrent requests run as one batched forward, their caches stacked
(`kv_batch.py`); a window of embeddings runs on its own, and so does a prompt but where
`prefillBatchTokens` (by default on CUDA) runs the prompts of token ids that queue together, on
new caches, as one forward (the forwards: lm_steps.py).

Inputs: the client request (`messages`, chat template applied by the tokenizer) or, from an
upstream stage, `inputs_embeds` [n, hidden] (after the edge's processor) or `token_ids` [n].
Outputs per step: the token id, the text delta (if the model has a tokenizer), and with
`returnHiddenStates: true` the last layer's hidden state that produced the token.

With `mode: encode` the model is a text encoder instead (as Qwen-Image conditions its diffusion
transformer on a Qwen2 model's hidden states): one forward pass over the request's prompt, and
over its `negative_prompt` if it has one, emitting the last layer's states as one unit,
`prompt_embeds` [1, tokens, hidden] (and `negative_prompt_embeds`).

A client's request that names a `prompt_cache_key` keeps its sequence when it ends, and the
key's next request prefills only what its prompt adds to it (prompt_cache.py).

Arguments (`engine.args`): mode (generate, encode), device, dtype, threads, returnHiddenStates,
tokensPerInputUnit (new tokens per input unit for upstream inputs), ignoreEos, maxBatch,
toolCallParser (vLLM's tool parser for the model family, for `tool_choice: auto`; tools.py),
promptCaches, promptCacheIdleS (prompt_cache.py), prefillBatchTokens (kv_batch.prefill_budget).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from omni_pipeline.payloads import PromptEmbeds, Tokens, gather
from omni_pipeline.sampling import params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import ComputeEngine, EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.kv_batch import prefill_budget
from omni_stage.engines.lm_steps import Decoding, LMStep, LMSteps
from omni_stage.engines.prompt_cache import Sequence
from omni_stage.engines.prompts import check_context, prompt_token_ids
from omni_stage.engines.reply import ReplyText, token_logprobs
from omni_stage.engines.sampling import HONOURED, TokenSampler
from omni_stage.engines.structured import JsonGrammars
from omni_stage.engines.tools import engine_honours, tool_plan
from omni_stage.segments import EngineOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TransformersEngine(ComputeEngine):
    weights = ("model",)

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.tool_parser: str | None = self.args.get("toolCallParser")
        self.honours = engine_honours(HONOURED | params("truncate_prompt_tokens"))
        self.dtype = _DTYPES[self.args.get("dtype", "float32")]
        self.return_hidden = bool(self.args.get("returnHiddenStates", False))
        self.tokens_per_input_unit = float(self.args.get("tokensPerInputUnit", 1.0))
        self.ignore_eos = bool(self.args.get("ignoreEos", False))
        mode = self.args.get("mode", "generate")
        if mode not in ("generate", "encode"):
            raise EngineError(f"stage '{stage.name}': engine.args.mode must be 'generate' or 'encode'")
        self.encode = mode == "encode"
        self.prompt_caches = None if self.encode else self._kept_conversations()
        self.model: Any = None
        self.tokenizer: Any = None
        self.eos: set[int] = set()
        self.vocab_size = 0
        self.context = 0
        self.grammars: JsonGrammars | None = None
        self.prefill_tokens = prefill_budget(self.args, self.device, stage.name)
        """`prefillBatchTokens` (kv_batch.prefill_budget): the prompts of token ids that queue
        together on new caches, prefilled together."""
        self.steps = LMSteps(self)
        self.batcher = StepBatcher(self.steps.run, self._compute, self.max_batch)

    async def start(self) -> None:
        await self._load_alone()

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a server's log is not a terminal

        if threads := self.args.get("threads"):
            torch.set_num_threads(int(threads))
        path = self.stage.engine.model
        assert path is not None
        if path.startswith((".", "/")) and not Path(path).is_dir():
            raise EngineError(
                f"stage '{self.stage.name}': model directory {path!r} not found (from {Path.cwd()})"
            )
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        except OSError as exc:
            raise EngineError(f"stage '{self.stage.name}': cannot load model {path!r}: {exc}") from exc
        if Path(path, "tokenizer.json").exists() or Path(path, "tokenizer_config.json").exists():
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.context = int(self.model.config.max_position_embeddings)  # kept while asleep
        if self.tokenizer is not None and "response_format" in self.honours:
            self.grammars = JsonGrammars(self.tokenizer, self.vocab_size, sorted(self.eos))

    def prompt_tokenizer(self) -> tuple[Any, int] | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer, self.context

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        if self.encode:
            yield await self._encode(call)
            return
        st = call.kept(Decoding)
        # Off the event loop: tokenizing a long prompt must not stall it (and with it the
        # replica's heartbeats).
        ids, embeds, n_units = await self._build(self._inputs, call)
        prompt = ids[0].tolist() if ids is not None and st.sampler is None else None
        max_tokens = call.sampling.max_tokens
        key = call.sampling.prompt_cache_key
        if "request" in call.inputs:
            budget = max_tokens or 64
            check_context(n_units, budget, self.model.config.max_position_embeddings)
            call.state.prompt_tokens += n_units
            assert ids is not None
            st.tokens = ids[0].tolist()
            if key is not None and call.sampling.prompt_logprobs is None:
                assert self.prompt_caches is not None
                ids = self._reuse(call, st, await self.prompt_caches.take(key), ids)
        else:
            budget = math.ceil(n_units * self.tokens_per_input_unit)
            if max_tokens:
                budget = min(budget, max_tokens)
        if st.sampler is None:
            # Off the event loop, and off the compute thread, whose forwards other requests wait
            # for: vLLM's tool code imports slowly the first time, a grammar compiles against
            # the whole vocabulary.
            st.tools = await asyncio.to_thread(tool_plan, call.sampling, self.tokenizer, self.tool_parser)
            schema = st.tools.schema if st.tools else None
            st.sampler = await asyncio.to_thread(
                lambda: TokenSampler(
                    call.sampling,
                    self.vocab_size,
                    self.grammars,
                    schema,
                    eos=frozenset() if self.ignore_eos else frozenset(self.eos),
                    prompt=prompt,
                    tokenizer=self.tokenizer,
                )
            )
            st.reply = ReplyText.for_request(self.tokenizer, call.sampling) if self.tokenizer else None
        feed_ids, feed_embeds = self._with_pending(st, ids, embeds)
        reply, tools, sampler = st.reply, st.tools, st.sampler
        assert sampler is not None  # set on the first call, above
        st.key = key if "request" in call.inputs else None
        with self._keeping_if_cut(st):  # a barge-in: what it made is kept
            for i in range(budget):
                step = LMStep(st, feed_ids, feed_embeds, sampler)
                choice, hidden = await self.batcher.submit(self.steps.key(step), step)
                if st.prompt_logprobs is not None and "request" in call.inputs:
                    call.state.prompt_logprobs, st.prompt_logprobs = st.prompt_logprobs, None
                tok = choice.token
                feed_ids, feed_embeds = torch.tensor([[tok]], device=self.device), None
                st.pending = tok  # sampled, not yet fed: the next step (or call) feeds it
                ended = sampler.ends(tok)
                delta, stopped = (
                    ("", False)
                    if reply is None
                    else reply.add(
                        None if ended and not reply.include_stop else tok, ended or i == budget - 1
                    )
                )
                done = ended or stopped
                data = Tokens(token_ids=torch.tensor([tok], dtype=torch.int64))
                if self.return_hidden:
                    data["hidden_states"] = hidden
                logprobs = token_logprobs(self.tokenizer, choice) if reply is not None and not ended else []
                out = EngineOutput(
                    units=1, text=delta, data=data, finish_reason="stop" if done else None, logprobs=logprobs
                )
                if "request" in call.inputs:
                    st.tokens.append(tok)
                    if done or i == budget - 1:  # complete: the sequence is kept for the key's next request
                        self._keep(st)
                yield out if tools is None else tools.settle(out, done or i == budget - 1)
                if done:
                    return
        if "request" in call.inputs:
            call.state.finish_reason = "length"

    def _reuse(self, call: EngineCall, st: Decoding, seq: Sequence | None, ids: torch.Tensor) -> torch.Tensor:
        """Start the request on the key's kept sequence, as far as its prompt shares it (that
        cache, cut to the shared positions, becomes the request's); returns the rest of the
        prompt, which the prefill computes."""
        assert self.prompt_caches is not None
        if seq is None or not (n := seq.shared(st.tokens, [])):
            return ids
        seq.cut(n)
        st.past = seq.past
        call.state.cached_tokens = n
        self.prompt_caches.reused_tokens += n
        return ids[:, n:]

    def _keep(self, st: Decoding) -> None:
        if st.key is None or st.kept or st.past is None or self.prompt_caches is None:
            return
        st.kept = True
        # The last token sampled is not fed: not held.
        self.prompt_caches.keep(st.key, Sequence.left(st.tokens, st.past, [], {}))

    async def _encode(self, call: EngineCall) -> EngineOutput:
        request = call.inputs.get("request")
        if request is None or self.tokenizer is None:
            raise EngineError(
                f"stage '{self.stage.name}': mode encode reads the client request with a tokenizer"
            )
        ids = await self._build(prompt_token_ids, self.tokenizer, request)
        data = PromptEmbeds(prompt_embeds=await self._run(self._last_hidden, ids))
        if negative := request.get("negative_prompt"):
            negative_ids = await self._build(prompt_token_ids, self.tokenizer, {"prompt": str(negative)})
            data["negative_prompt_embeds"] = await self._run(self._last_hidden, negative_ids)
        call.state.prompt_tokens = len(ids)
        return EngineOutput(units=1, data=data)

    @torch.inference_mode()
    def _last_hidden(self, ids: list[int]) -> torch.Tensor:
        out = self.model.base_model(input_ids=torch.tensor([ids], device=self.device))
        return out.last_hidden_state.float().cpu()

    def _with_pending(
        self, st: Decoding, ids: torch.Tensor | None, embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Prepend the previous call's last sampled token, so windowed calls extend one sequence."""
        pending, st.pending = st.pending, None
        if pending is None:
            return ids, embeds
        tok = torch.tensor([[pending]], device=self.device)
        if embeds is not None:
            with torch.inference_mode():
                tok_embed = self.model.get_input_embeddings()(tok).to(embeds.dtype)
            return None, torch.cat([tok_embed, embeds], dim=1)
        assert ids is not None
        return torch.cat([tok, ids], dim=1), None

    def _inputs(self, call: EngineCall) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        if st_req := call.inputs.get("request"):
            if self.tokenizer is None:
                raise EngineError(f"stage '{self.stage.name}' has no tokenizer to read a request")
            ids = prompt_token_ids(self.tokenizer, st_req, call.sampling)
            return torch.tensor([ids], device=self.device), None, len(ids)
        if embeds := gather(call.inputs, "inputs_embeds"):
            e = torch.cat(embeds, dim=0).to(self.device, self.dtype)
            return None, e.unsqueeze(0), int(e.shape[0])
        if toks := gather(call.inputs, "token_ids"):
            t = torch.cat(toks, dim=0).to(self.device)
            return t.unsqueeze(0), None, int(t.shape[0])
        raise EngineError(f"stage '{self.stage.name}': inputs carry neither inputs_embeds nor token_ids")
