"""Qwen2.5-Omni's thinker on vLLM: `engine: {kind: vllm, model: DIR, args: {part: thinker}}`.

vLLM decodes (continuous batching, its paged KV cache, its own multimodal processing of the
audio, images and videos the gateway decoded), and the stage sends the talker what the
transformers thinker sends (qwen_omni.py): per token, the input embedding and last hidden state
of the position that consumed the token before it, and with the first the prompt's. The hidden
states come from vLLM's workers (engines/vllm/hidden.py: our `worker_cls` pushes each step's rows); the
input embeddings are rows of the thinker's embedding table, read alone from the checkpoint,
zeros where the prompt holds audio, image or video features (as the reference hands them to
its talker).

Prefix caching is off: a cached prefix is not computed again, so its hidden states would
never come. Speculative decoding is refused: its rejected draft tokens' states would be sent.
Chunked prefill is fine (each chunk's rows carry their positions).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any, Final

import torch

from omni_pipeline.payloads import ThinkerStep
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import REQUEST_SOURCE, StageSpec
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest
from omni_stage.engines.sampling import HONOURED
from omni_stage.engines.vllm.engine import VllmEngine, vllm_logprobs, vllm_prompt_logprobs
from omni_stage.engines.vllm.hidden import ADDRESS_ENV, HiddenStates
from omni_stage.models.qwen_omni.parts import thinker_embedding_table
from omni_stage.models.qwen_omni.prompt import Prompts, processor_kwargs
from omni_stage.segments import EngineOutput

HIDDEN_WAIT_S: Final = 60.0
"""How long a token's hidden state may lag its token (it is sent before the token is sampled)."""
V2_RUNNER_ENV: Final = "VLLM_USE_V2_MODEL_RUNNER"
_WORKERS: Final = {
    "cpu": "omni_stage.engines.vllm.worker.CPUHiddenStatesWorker",
    "cuda": "omni_stage.engines.vllm.worker.GPUHiddenStatesWorker",
}


class VllmThinker(VllmEngine):
    own_args = frozenset({"toolCallParser", "part"})

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        # What the transformers Qwen thinker honours: no tools (a reply that is a call has no
        # speech), so the gateway refuses them rather than this engine dropping them.
        self.honours = HONOURED | params("mm_processor_kwargs")
        if self.args.get("enable_prefix_caching"):
            raise EngineError(
                f"stage '{stage.name}': enable_prefix_caching: a cached prefix's hidden states are not "
                "computed again, and the talker needs them"
            )
        if self.args.get("speculative_config"):
            raise EngineError(
                f"stage '{stage.name}': speculative_config: the hidden states of draft tokens vLLM "
                "rejects would reach the talker"
            )
        if other := [e.from_ for e in stage.inputs if e.from_ != REQUEST_SOURCE]:
            raise EngineError(
                f"stage '{stage.name}': inputs: the thinker on vLLM reads only `request`, not {other[0]!r}: "
                "it runs its own encoders (vLLM 0.32 takes no audio embeddings for Qwen2.5-Omni), so an "
                "encoder stage in front of it would encode every medium twice; use the transformers thinker"
            )
        self.hidden: HiddenStates | None = None
        self.prompts: Prompts | None = None
        self.embeds: torch.Tensor | None = None

    def _engine_args(self, platform: Any) -> dict[str, Any]:
        args = super()._engine_args(platform)
        if (worker := _WORKERS.get(platform.device_type)) is None:
            raise EngineError(
                f"stage '{self.stage.name}': the Qwen thinker on vLLM runs on CPUs and CUDA GPUs, "
                f"not {platform.device_type}"
            )
        args.setdefault("worker_cls", worker)
        args["enable_prefix_caching"] = False
        return args

    async def start(self) -> None:
        from transformers import Qwen2_5OmniConfig

        if os.environ.setdefault(V2_RUNNER_ENV, "0") != "0":
            raise EngineError(
                f"stage '{self.stage.name}': {V2_RUNNER_ENV}={os.environ[V2_RUNNER_ENV]}: the Qwen "
                "thinker's hidden states are read from vLLM's V1 model runner"
            )
        self.hidden = HiddenStates()
        self.hidden.start()
        os.environ[ADDRESS_ENV] = self.hidden.address  # vLLM's workers inherit it
        await super().start()
        path = str(self.stage.engine.model)
        config = await asyncio.to_thread(Qwen2_5OmniConfig.from_pretrained, path)
        self.prompts = await asyncio.to_thread(
            Prompts, path, self.tokenizer, config.thinker_config, torch.device("cpu"), torch.float32
        )
        self.accepts = self.prompts.accepts
        self.embeds = (await asyncio.to_thread(thinker_embedding_table, self.stage.name, path)).float()

    def _vllm_prompt(self, request: dict[str, Any], sampling: Sampling) -> dict[str, Any]:
        """The chat template's text and the media, for vLLM's own processor of this model."""
        assert self.prompts is not None
        if "messages" not in request:  # a bare prompt (speech's input), as the transformers thinker
            ids = self.tokenizer(str(request.get("prompt", "")), add_special_tokens=False)["input_ids"]
            return {"prompt_token_ids": ids}
        chat = self.prompts.read(request, sampling=sampling)
        media: dict[str, Any] = {}
        if chat.audios:
            rate = self.prompts.audio.rate
            media["audio"] = [(a, rate) for a in chat.audios]
        if chat.images:
            media["image"] = chat.images
        if not media and not chat.videos:
            return {"prompt": chat.text}
        prompt: dict[str, Any] = {"prompt": chat.text, "multi_modal_data": media}
        if extra := processor_kwargs(sampling):  # vLLM hands them to the model's processor, as we do
            prompt["mm_processor_kwargs"] = extra
        if chat.videos:
            if len(set(chat.video_fps)) > 1:  # the model's processor takes one rate for all
                raise InvalidRequest("the videos of one request must be taken at one rate (videoFps)")
            media["video"] = chat.videos
            prompt["mm_processor_kwargs"] = {
                **prompt.get("mm_processor_kwargs", {}),
                "fps": chat.video_fps[0],
            }
        return prompt

    def _prompt_embeds(self, ids: list[int]) -> torch.Tensor:
        """[1, P, hidden]: the prompt's input embeddings, zeros at media positions."""
        assert self.embeds is not None and self.prompts is not None
        t = torch.tensor(ids)
        rows = self.embeds[t]
        return rows.masked_fill(torch.isin(t, self.prompts.media_ids)[:, None], 0.0)[None]

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        from vllm.exceptions import VLLMClientError

        assert self.hidden is not None and self.embeds is not None
        request = call.inputs.get("request")
        if request is None:
            raise EngineError(f"stage '{self.stage.name}': the thinker reads the client request")
        prompt = await asyncio.to_thread(self._vllm_prompt, request, call.sampling)
        vllm_id = f"{call.request_id}-{next(self._ids)}"
        top = call.sampling.top_logprobs or 0
        self.hidden.expect(vllm_id)
        finished = False
        try:
            n_prompt, unit, previous = 0, 0, 0
            async for out in self.llm.generate(prompt, self._sampling(call, None), request_id=vllm_id):
                if unit == 0 and not n_prompt:
                    n_prompt = len(out.prompt_token_ids)
                    call.state.prompt_tokens = n_prompt
                if out.prompt_logprobs is not None and call.state.prompt_logprobs is None:
                    call.state.prompt_logprobs = vllm_prompt_logprobs(
                        list(out.prompt_token_ids), out.prompt_logprobs
                    )
                c = out.outputs[0]
                finished = out.finished
                ids = list(c.token_ids)
                finish = c.finish_reason if finished else None
                logprobs = vllm_logprobs(ids, c.logprobs, top)
                if not ids and (c.text or finish):
                    yield EngineOutput(units=0, text=c.text, finish_reason=finish)
                for j, tok in enumerate(ids):
                    data = ThinkerStep(token_ids=torch.tensor([tok]))
                    if unit == 0:
                        rows = await self.hidden.rows(vllm_id, 0, n_prompt, HIDDEN_WAIT_S)
                        data["prompt_embeds"] = self._prompt_embeds(list(out.prompt_token_ids))
                        data["prompt_hidden"] = rows[None]
                    else:
                        at = n_prompt + unit - 1
                        rows = await self.hidden.rows(vllm_id, at, at + 1, HIDDEN_WAIT_S)
                        data["reply_embeds"] = self.embeds[previous][None]
                        data["reply_hidden"] = rows
                    last = j == len(ids) - 1
                    yield EngineOutput(
                        units=1,
                        text=c.text if last else "",
                        data=data,
                        finish_reason=finish if last else None,
                        logprobs=logprobs[j : j + 1],
                    )
                    unit, previous = unit + 1, tok
        except TimeoutError:
            raise EngineError(
                f"stage '{self.stage.name}': vLLM sent no hidden states for {vllm_id} in {HIDDEN_WAIT_S:g} s "
                "(is engine.args.worker_cls one of omni_stage.engines.vllm.worker.s?)"
            ) from None
        except VLLMClientError as exc:  # vLLM's own word that the request is at fault (a 400)
            raise InvalidRequest(str(exc)) from None
        finally:
            self.hidden.done(vllm_id)
            if not finished:  # cancelled or failed: free it in vLLM now, not at its max_tokens
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.llm.abort(vllm_id))

    async def close(self) -> None:
        await super().close()
        if self.hidden is not None:
            await self.hidden.close()
            self.hidden = None
