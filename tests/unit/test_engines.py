"""Engines driven directly (no processes): the transformers step loop against Hugging Face's own
generate, input embeddings and KV continuation across windowed calls, the torch and synthetic
engines."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall, EngineError, InvalidRequest
from omni_stage.engines.prompt_cache import MediaSpan, PromptCaches, Sequence
from omni_stage.engines.registry import build_engine
from omni_stage.engines.tools import ToolPlan
from omni_stage.processors import thinker_to_talker
from omni_stage.segments import EngineOutput
from tests.helpers import ROOT, WEATHER, asked_while_held, logits_positions, ran, wait_until

EXAMPLE = ROOT / "examples" / "tiny-omni.yaml"


def engine_for(stage: str, models: Path, **engine_overrides: Any) -> Engine:
    spec = load_pipeline(EXAMPLE).spec.stage(stage)
    eng = spec.engine
    updates: dict[str, Any] = {}
    if eng.model:
        updates["model"] = str(models / Path(eng.model).name)
    if "path" in eng.args:
        updates["args"] = {**eng.args, "path": str(models / "tiny-vocoder")}
    updates.update(engine_overrides)
    return build_engine(spec.model_copy(update={"engine": eng.model_copy(update=updates)}))


def engine_for_args(stage: str) -> dict[str, Any]:
    """The example stage's engine arguments (to add to)."""
    return dict(load_pipeline(EXAMPLE).spec.stage(stage).engine.args)


def run(engine: Engine, call: EngineCall) -> list[EngineOutput]:
    async def go() -> list[EngineOutput]:
        await engine.start()
        return [o async for o in engine.generate(call)]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def models(demo_dir: Path) -> Path:
    return demo_dir / "models"


def test_thinker_greedy_matches_hf_generate(models: Path) -> None:
    messages = [{"role": "user", "content": "What is omni?"}]
    outs = run(
        engine_for("thinker", models),
        EngineCall("r", {"request": {"messages": messages}}, True, Sampling(max_tokens=12)),
    )
    ours = [int(o.data["token_ids"][0]) for o in outs]

    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    model = AutoModelForCausalLM.from_pretrained(models / "tiny-thinker")
    prompt = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    ids = torch.tensor([prompt["input_ids"]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    assert ours == ref
    assert "".join(o.text for o in outs) == tok.decode(ref, skip_special_tokens=True)
    assert all(o.data["hidden_states"].shape == (1, 64) for o in outs)


def test_talker_takes_embeddings_and_continues_across_calls(models: Path) -> None:
    """A `transformers` talker fed windows of embeddings continues one sequence across calls;
    a window's forward computes the logits of its last position alone (last_logits.py)."""
    engine = engine_for("talker", models)
    hidden = torch.randn(16, 64)
    state = CallState()
    first = run(
        engine,
        EngineCall(
            "r", {"thinker": thinker_to_talker({"hidden_states": hidden[:8]})}, False, Sampling(), state
        ),
    )
    assert len(first) == 8 * 4 and all(0 <= int(o.data["token_ids"][0]) < 256 for o in first)
    cached = state.engine.past.get_seq_length()
    call = EngineCall(
        "r", {"thinker": thinker_to_talker({"hidden_states": hidden[8:]})}, True, Sampling(), state
    )

    async def go() -> tuple[list[EngineOutput], list[int]]:
        await engine.start()  # (on this event loop; the model as it loaded)
        with logits_positions(engine.model.get_output_embeddings()) as positions:  # type: ignore[attr-defined]
            return [o async for o in engine.generate(call)], positions

    second, positions = asyncio.run(go())
    assert len(second) == 32
    assert positions and set(positions) == {1}, positions  # the window's 9 positions: its last's logits
    # One sequence, not a fresh start: call 1's last token, call 2's 8 inputs, 31 of its 32 tokens.
    assert state.engine.past.get_seq_length() == cached + 1 + 8 + 31


def test_concurrent_requests_decode_in_batched_steps_with_the_same_output(models: Path) -> None:
    """Three chat requests of different prompt lengths on one thinker replica, and two windowed
    embedding streams on one talker replica, asked while each replica's compute thread is held
    (asked_while_held: every request's first step is queued before any runs, however slowly
    its prompt is built): their one-token decode steps run as batches (caches stacked,
    left-padded, masked), and each request gets exactly the tokens it gets alone, its hidden
    states within 1e-5 of their largest (a batched matmul may sum in another order: on an
    AVX-512 CPU, MKL's batched kernels put one state 1.3e-5 off, at 3.6)."""
    prompts = [
        "hi",
        "What is omni, and why does it speak?",
        "A longer question still, so the caches differ: why?",
    ]
    hidden = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    async def go() -> tuple[list[Any], list[Any], Any, Any]:
        thinker, talker = engine_for("thinker", models), engine_for("talker", models)
        await thinker.start()
        await talker.start()

        async def think(prompt: str) -> tuple[list[int], torch.Tensor]:
            request = {"messages": [{"role": "user", "content": prompt}]}
            outs = [
                o
                async for o in thinker.generate(
                    EngineCall("r", {"request": request}, True, Sampling(max_tokens=12))
                )
            ]
            return [int(o.data["token_ids"][0]) for o in outs], torch.cat(
                [o.data["hidden_states"] for o in outs]
            )

        async def talk(states: torch.Tensor) -> list[int]:
            state = CallState()
            tokens: list[int] = []
            for window, last in ((states[:8], False), (states[8:], True)):
                call = EngineCall(
                    "r", {"thinker": thinker_to_talker({"hidden_states": window})}, last, Sampling(), state
                )
                tokens += [int(o.data["token_ids"][0]) async for o in talker.generate(call)]
            return tokens

        thought, talked = await asyncio.gather(
            asked_while_held(thinker, thinker.batcher, [think(p) for p in prompts]),  # type: ignore[attr-defined]
            asked_while_held(talker, talker.batcher, [talk(h) for h in hidden]),  # type: ignore[attr-defined]
        )
        together = thought + talked
        sizes = thinker.batcher.batch_sizes.copy(), talker.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await think(p) for p in prompts] + [await talk(h) for h in hidden]
        return together, alone, *sizes

    together, alone, thinker_batches, talker_batches = asyncio.run(go())
    assert max(thinker_batches) == 3 and max(talker_batches) == 2, (thinker_batches, talker_batches)
    for (tokens, states), (tokens_alone, states_alone) in zip(together[:3], alone[:3], strict=True):
        assert tokens == tokens_alone
        torch.testing.assert_close(states, states_alone, rtol=0, atol=1e-5 * float(states_alone.abs().max()))
    assert together[3:] == alone[3:]


def test_prompts_queued_together_are_prefilled_together_as_each_alone(models: Path) -> None:
    """With `prefillBatchTokens` (on CUDA by default), three prompts asked while the compute
    thread is held (their tokens are built beside it): the first prefill to queue runs alone,
    the two queued behind it in one forward (kv_batch.prefill_together), and each request gets
    the tokens it gets alone, its hidden states within 1e-5 of their largest (a batched
    matmul may sum in another order); no forward's logits are computed at more than one
    position a request, alone or together. A budget that is not a whole number is refused
    when the stage is built."""
    prompts = ["hi", "What is omni, and why does it speak?", "A longer question still: why?"]

    async def go() -> tuple[list[Any], list[Any], list[int]]:
        thinker = engine_for(
            "thinker", models, args={**engine_for_args("thinker"), "prefillBatchTokens": 2048}
        )
        await thinker.start()

        async def think(prompt: str) -> tuple[list[int], torch.Tensor]:
            request = {"messages": [{"role": "user", "content": prompt}]}
            call = EngineCall(prompt, {"request": request}, True, Sampling(max_tokens=8))
            outs = [o async for o in thinker.generate(call)]
            return [int(o.data["token_ids"][0]) for o in outs], torch.cat(
                [o.data["hidden_states"] for o in outs]
            )

        with logits_positions(thinker.model.get_output_embeddings()) as positions:  # type: ignore[attr-defined]
            alone = [await think(p) for p in prompts]
            batcher = thinker.batcher  # type: ignore[attr-defined]
            before = Counter(batcher.calls)
            together = await asked_while_held(thinker, batcher, [think(p) for p in prompts])
        await thinker.close()
        assert positions and set(positions) == {1}, positions
        return alone, together, ran(batcher, before, "prefill")

    alone, together, prefills = asyncio.run(go())
    assert prefills == [1, 2], prefills
    for (tokens, states), (tokens_alone, states_alone) in zip(together, alone, strict=True):
        assert tokens == tokens_alone
        torch.testing.assert_close(states, states_alone, rtol=0, atol=1e-5 * float(states_alone.abs().max()))
    with pytest.raises(EngineError, match=r"prefillBatchTokens must be a whole number, 0 or more, got 1\.5"):
        engine_for("thinker", models, args={**engine_for_args("thinker"), "prefillBatchTokens": 1.5})


def test_a_prompts_build_running_is_watched_as_a_forward_is(models: Path) -> None:
    """The wedge check (`busy_s`, against `stepTimeoutSeconds`) sees a build on the prompt
    thread as it sees a forward on the compute thread: a build stuck there would keep every
    request after it from starting."""

    async def go() -> None:
        engine = engine_for("thinker", models)
        gate = threading.Event()
        assert engine.busy_s() is None
        build = asyncio.ensure_future(engine._build(gate.wait))  # type: ignore[attr-defined]
        try:
            await wait_until(lambda: engine.busy_s() is not None, 30, "the build seen running")
        finally:
            gate.set()
        await build
        assert engine.busy_s() is None
        await engine.close()

    asyncio.run(go())


def test_sampling_is_seeded(models: Path) -> None:
    engine = engine_for("thinker", models)
    req = {"request": {"messages": [{"role": "user", "content": "hi"}]}}

    def sample(seed: int) -> list[int]:
        call = EngineCall("r", req, True, Sampling(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed))
        return [int(o.data["token_ids"][0]) for o in run(engine, call)]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_a_vanishing_temperature_is_greedy_and_an_empty_prompt_the_clients_error(models: Path) -> None:
    """Both found by schemathesis against the real models: a temperature of 1e-154 made the
    logits inf and the sampler raise; text the tokenizer drops whole made an empty prompt."""
    engine = engine_for("thinker", models)
    req = {"request": {"messages": [{"role": "user", "content": "hi"}]}}

    def tokens(sampling: dict[str, Any]) -> list[int]:
        call = EngineCall("r", req, True, Sampling.of({"max_tokens": 6, **sampling}))
        return [int(o.data["token_ids"][0]) for o in run(engine, call)]

    assert tokens({"temperature": 2.7e-154, "seed": 3}) == tokens({"temperature": 0})
    with pytest.raises(InvalidRequest, match="the prompt is empty once tokenized"):
        run(engine, EngineCall("r", {"request": {"prompt": ""}}, True, Sampling()))


def test_stop_ends_the_reply_before_the_stop_string(models: Path) -> None:
    engine = engine_for("thinker", models)
    req = {"request": {"messages": [{"role": "user", "content": "hi"}]}}
    full = "".join(o.text for o in run(engine, EngineCall("r", req, True, Sampling(max_tokens=24))))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and full.find(stop) > 0, full
    outs = run(engine, EngineCall("r", req, True, Sampling(max_tokens=24, stop=[stop])))
    assert "".join(o.text for o in outs) == full[: full.find(stop)]
    assert outs[-1].finish_reason == "stop" and len(outs) < 24


def test_logit_bias_is_transformers_sequence_bias_and_logprobs_its_raw_scores(models: Path) -> None:
    """The reference for logit_bias is transformers' own `sequence_bias` (one-token sequences);
    for logprobs, the log-softmax of the model's raw logits, which generate returns. (Penalties
    are checked against vLLM's sampler in tests/integration/test_vllm.py.)"""
    messages = [{"role": "user", "content": "What is omni?"}]
    engine = engine_for("thinker", models)
    plain = [
        int(o.data["token_ids"][0])
        for o in run(
            engine, EngineCall("r", {"request": {"messages": messages}}, True, Sampling(max_tokens=12))
        )
    ]
    bias = {plain[2]: -100.0, 11: 3.0}
    sampling = {
        "max_tokens": 12,
        "logit_bias": {str(k): v for k, v in bias.items()},
        "logprobs": True,
        "top_logprobs": 2,
    }
    outs = run(engine, EngineCall("r", {"request": {"messages": messages}}, True, Sampling.of(sampling)))
    ours = [int(o.data["token_ids"][0]) for o in outs]

    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    model = AutoModelForCausalLM.from_pretrained(models / "tiny-thinker")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    ref = model.generate(
        ids,
        max_new_tokens=12,
        do_sample=False,
        sequence_bias={(k,): v for k, v in bias.items()},
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert ours == ref.sequences[0, ids.shape[1] :].tolist() != plain and plain[2] not in ours
    raw = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
    got = [lp for o in outs for lp in o.logprobs]
    assert [g.token for g in got] == [tok.decode([t]) for t in ours[: len(got)]] and len(got) >= len(ours) - 1
    assert [g.logprob for g in got] == pytest.approx(
        [float(raw[i][t]) for i, t in enumerate(ours[: len(got)])], abs=1e-5
    )
    for i, g in enumerate(got):
        best = torch.topk(raw[i], 2)
        assert [t for t, _ in g.top] == [tok.decode([t]) for t in best.indices.tolist()]


def test_a_logit_bias_outside_the_vocabulary_is_the_clients_error(models: Path) -> None:
    req = {"request": {"messages": [{"role": "user", "content": "hi"}]}}
    with pytest.raises(InvalidRequest, match="logit_bias: token 999999 is not in the vocabulary"):
        run(engine_for("thinker", models), EngineCall("r", req, True, Sampling(logit_bias={"999999": 1.0})))


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_json_mode_constrains_the_reply_to_the_schema(models: Path) -> None:
    """Through xgrammar, as vLLM constrains it (their equality: tests/integration/test_vllm.py).
    The tiny random model's greedy reply to this prompt closes its object within the budget;
    to another it may write one key for ever, which the grammar allows (a `length` finish)."""
    engine = engine_for("thinker", models)
    req = {"request": {"messages": [{"role": "user", "content": "Give me JSON"}]}}
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "schema": SCHEMA}):
        outs = run(
            engine, EngineCall("r", req, True, Sampling(max_tokens=64, response_format=response_format))
        )
        reply = json.loads("".join(o.text for o in outs))
        assert isinstance(reply, dict) and outs[-1].finish_reason == "stop"
    jsonschema.validate(reply, SCHEMA)
    bad = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}
    with pytest.raises(InvalidRequest, match="response_format: the schema cannot be used"):
        run(engine, EngineCall("r", req, True, Sampling(response_format=bad)))


def test_a_named_or_required_tool_choice_constrains_the_reply_to_calls(models: Path) -> None:
    """vLLM's schema for the choice (its own code), through the engine's grammar: a named choice
    is one call of that function, `required` one or more; arguments valid against the tool's
    parameters. Without a parser, `auto` is refused before any output."""
    engine = engine_for("thinker", models)
    params = WEATHER["function"]["parameters"]  # type: ignore[index]
    req = {"request": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    outs = run(
        engine, EngineCall("r", req, True, Sampling(max_tokens=64, tools=[WEATHER], tool_choice=named))
    )
    fragments = [c for o in outs for c in o.tool_calls]  # streamed as the arguments come
    assert len({(c.id, c.name) for c in fragments}) == 1 and fragments[0].name == "get_weather"
    assert len(fragments) > 1 and outs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.arguments for c in fragments)), params)
    assert "".join(o.text for o in outs) == ""  # the call is the whole reply
    outs = run(
        engine, EngineCall("r", req, True, Sampling(max_tokens=250, tools=[WEATHER], tool_choice="required"))
    )
    assert outs[-1].tool_calls and outs[-1].finish_reason == "tool_calls"
    for call in outs[-1].tool_calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), params)
    with pytest.raises(InvalidRequest, match="tool_choice: 'auto' needs the model's tool call parser"):
        run(engine, EngineCall("r", req, True, Sampling(tools=[WEATHER], tool_choice="auto")))


def test_auto_tool_calls_are_read_with_vllms_parser_for_the_model_family(models: Path) -> None:
    """What the model wrote, read by vLLM's hermes parser (Qwen2.5's format): the text before
    the call stays content. (A random tiny model never writes a call; this is a reply one
    would write.)"""
    tokenizer = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    plan = ToolPlan(Sampling(tools=[WEATHER], tool_choice="auto"), tokenizer, "hermes")
    assert plan.schema is None
    reply = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    out = plan.settle(EngineOutput(units=1, text=reply, finish_reason="stop"), last=True)
    assert out.text == "Let me look. " and out.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Rome"})]
    one = ToolPlan(Sampling(tools=[WEATHER], parallel_tool_calls=False), tokenizer, "hermes")
    out = one.settle(
        EngineOutput(units=1, text=reply + reply[len("Let me look. ") :], finish_reason="stop"), last=True
    )
    assert len(out.tool_calls) == 1  # parallel_tool_calls false: the first call only, as vLLM keeps
    plain = ToolPlan(Sampling(tools=[WEATHER]), tokenizer, "hermes")
    out = plain.settle(EngineOutput(units=1, text="no call here", finish_reason="stop"), last=True)
    assert (out.text, out.tool_calls, out.finish_reason) == ("no call here", [], "stop")


def test_vocoder_turns_codes_into_samples(models: Path) -> None:
    engine = engine_for("vocoder", models)
    (out,) = run(engine, EngineCall("r", {"talker": {"token_ids": torch.arange(25)}}, True, Sampling()))
    assert out.units == 25 * 480 and out.data["sample_rate"] == 24000
    audio = out.data["audio"]
    assert audio.shape == (25 * 480,) and audio.abs().max() <= 1.0


def _call(stage: str) -> EngineCall:
    if stage == "thinker":
        messages = [{"role": "user", "content": "Sleep well"}]
        return EngineCall("r", {"request": {"messages": messages}}, True, Sampling(max_tokens=8))
    return EngineCall("r", {"talker": {"token_ids": torch.arange(25)}}, True, Sampling())


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("stage", ["thinker", "vocoder"])
def test_sleep_frees_the_weights_and_the_woken_engine_computes_the_same(
    models: Path, stage: str, level: int
) -> None:
    """Level 2 drops the weights (none held; waking loads them from the model's files again);
    level 1 moves them to host memory, where on the CPU they already are. Either way the woken
    engine's output equals its output before."""
    engine = engine_for(stage, models)

    async def go() -> tuple[
        list[EngineOutput], dict[str, int], dict[str, int], list[EngineOutput], dict[str, int]
    ]:
        await engine.start()
        before = [o async for o in engine.generate(_call(stage))]
        held = engine.weight_bytes()
        await engine.sleep(level)
        asleep = engine.weight_bytes()
        # What its heartbeat reads (whether it answers /tokenize) it still answers asleep.
        assert (engine.prompt_tokenizer() is not None) == (stage == "thinker")
        await engine.wake_up(level)
        after = [o async for o in engine.generate(_call(stage))]
        return before, held, asleep, after, engine.weight_bytes()

    before, held, asleep, after, woken = asyncio.run(go())
    assert held["cpu"] > 0 and woken == held
    assert asleep == ({} if level == 2 else held)
    key = "token_ids" if stage == "thinker" else "audio"
    assert [o.data[key].tolist() for o in after] == [o.data[key].tolist() for o in before]


def test_a_batched_module_runs_concurrent_windows_of_one_shape_as_one_call(models: Path) -> None:
    """Four vocoder windows of 25 codes (one at speed 2) and one of 10, on one replica at once:
    the three of one shape and speed that queued behind the first go as one call, the others
    alone; every waveform is what the window gives alone (within 1e-6: a batched conv may sum
    in another order)."""
    windows = [(torch.arange(25) + i, 1.0) for i in range(4)] + [
        (torch.arange(10), 1.0),
        (torch.arange(25), 2.0),
    ]

    async def go() -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        vocoder = engine_for("vocoder", models)
        await vocoder.start()

        async def speak(codes: torch.Tensor, speed: float) -> torch.Tensor:
            call = EngineCall("r", {"talker": {"token_ids": codes}}, True, Sampling(speed=speed))
            (out,) = [o async for o in vocoder.generate(call)]
            return out.data["audio"]

        together = await asyncio.gather(*(speak(*w) for w in windows))
        batched = vocoder.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await speak(*w) for w in windows]
        return together, alone, batched

    together, alone, batched = asyncio.run(go())
    assert batched == {1: 3, 3: 1}, batched
    for a, b in zip(together, alone, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert together[5].shape == (round(25 / 2) * 480,)


def test_missing_model_directory_is_named(tmp_path: Path) -> None:
    engine = engine_for("thinker", tmp_path)
    with pytest.raises(EngineError, match=r"model directory .* not found"):
        run(engine, EngineCall("r", {"request": {"messages": []}}, True, Sampling()))


def test_media_parts_are_the_clients_error_for_a_text_model(models: Path) -> None:
    engine = engine_for("thinker", models)
    msg = {"role": "user", "content": [{"type": "image", "media": "m0"}]}
    with pytest.raises(InvalidRequest, match="this model takes text only; it cannot read the 'image' part"):
        run(engine, EngineCall("r", {"request": {"messages": [msg]}}, True, Sampling()))


def test_synthetic_is_deterministic_and_can_be_poisoned() -> None:
    spec = load_pipeline(ROOT / "tests" / "data" / "synthetic.yaml").spec
    thinker = build_engine(spec.stage("thinker"))
    req = {"request": {"messages": [{"role": "user", "content": "x"}]}}
    a = run(thinker, EngineCall("r1", req, True, Sampling(max_tokens=5)))
    b = run(thinker, EngineCall("r1", req, True, Sampling(max_tokens=5)))
    assert [o.text for o in a] == [o.text for o in b] == [f"tok{i} " for i in range(5)]
    assert a[0].data["hidden_states"].shape == (1, 64)
    with pytest.raises(EngineError, match="poisoned"):
        run(
            thinker,
            EngineCall(
                "r2", {"request": {"messages": [{"role": "user", "content": "POISON"}]}}, True, Sampling()
            ),
        )


def test_a_conversation_kept_by_its_prompt_cache_key_prefills_only_its_new_turn(models: Path) -> None:
    """Turn 2 with turn 1's `prompt_cache_key`: the tokens turn 1's sequence holds (its prompt
    and its reply, as the chat template writes the reply back) are not computed again, and the
    reply is the one the whole prefill gives, which is Hugging Face's generate's (above). With
    `promptCaches: 0` nothing is kept; a sleeping engine gives up what it kept."""
    turn1 = [{"role": "user", "content": "What is omni?"}]

    async def go(engine: Engine) -> tuple[list[int], list[int], int, int]:
        await engine.start()

        async def ask(messages: list[dict[str, Any]], key: str | None) -> tuple[list[EngineOutput], int]:
            sampling = {"max_tokens": 12} | ({"prompt_cache_key": key} if key else {})
            call = EngineCall("r", {"request": {"messages": messages}}, True, Sampling.of(sampling))
            return [o async for o in engine.generate(call)], call.state.cached_tokens

        first, _ = await ask(turn1, "c")
        turn2 = [*turn1, {"role": "assistant", "content": "".join(o.text for o in first)}]
        turn2.append({"role": "user", "content": "Say more."})
        kept, cached = await ask(turn2, "c")
        whole, _ = await ask(turn2, None)
        await engine.sleep(0)
        _, after_sleep = await ask(turn2, "c")
        tokens = lambda outs: [int(o.data["token_ids"][0]) for o in outs]  # noqa: E731
        return tokens(kept), tokens(whole), cached, after_sleep

    kept, whole, cached, after_sleep = asyncio.run(go(engine_for("thinker", models)))
    assert kept == whole
    assert cached > 0 and after_sleep == 0
    _, _, none_kept, _ = asyncio.run(
        go(engine_for("thinker", models, args={"returnHiddenStates": True, "promptCaches": 0}))
    )
    assert none_kept == 0


def test_a_key_cut_mid_step_is_taken_once_what_it_made_is_kept() -> None:
    """A request cut mid-step (a barge-in) keeps what it made once that step ends; the key's
    next request, asking before then, waits and takes it, where it used to find nothing and
    prefill its whole prompt (test_realtime's cancelled response, once in eight suite runs).
    Another key's request does not wait, and a cut that kept nothing lets it go on."""

    async def go() -> None:
        caches = PromptCaches()
        caches.keep("other", Sequence([1], None))
        settled = caches.cut_mid_step("a")
        taking = asyncio.ensure_future(caches.take("a"))
        assert await caches.take("other") is not None  # not held up by another key's cut
        await asyncio.sleep(0)  # one turn of the loop: the take reaches its wait
        assert not taking.done()
        kept = Sequence([1, 2], None)
        caches.keep("a", kept)  # the cut request's step has ended...
        settled()  # ...and what it made is kept
        assert await taking is kept
        settled = caches.cut_mid_step("a")
        taking = asyncio.ensure_future(caches.take("a"))
        await asyncio.sleep(0)
        settled()  # nothing kept (the key's session ended meanwhile)
        assert await taking is None and await caches.take("a") is None

    asyncio.run(go())


def test_kept_sequences_are_bounded_by_count_and_idle_time() -> None:
    """The least recently used is given up beyond the capacity; one unused for the idle time is
    given up at the next look; a request takes its key's sequence (a second finds none); a
    forgotten key keeps nothing again."""
    caches = PromptCaches(capacity=2, idle_s=60)

    def take(key: str) -> Sequence | None:
        return asyncio.run(caches.take(key))

    for key in ("a", "b", "c"):
        caches.keep(key, Sequence([1, 2, 3], None))
    assert take("a") is None and len(caches) == 2
    b = take("b")
    assert b is not None and take("b") is None
    caches.keep("b", b)
    b.used -= 61  # as if a minute went by unused
    assert caches.expire() == 1 and take("b") is None
    assert caches.forget("c") and len(caches) == 0
    caches.keep("c", Sequence([1], None))  # a request of an ended session, ending late: not kept
    assert len(caches) == 0
    seq = Sequence([5, 6, 7, 8], None, [MediaSpan(1, 3, b"x")])
    assert seq.shared([5, 6, 7, 8, 9], [MediaSpan(1, 3, b"x")]) == 4
    assert seq.shared([5, 6, 7, 8, 9], [MediaSpan(1, 3, b"y")]) == 1  # other media: up to it
    assert seq.shared([5, 6, 7, 8], [MediaSpan(1, 3, b"x")]) == 3  # the last position is computed
    assert seq.shared([5, 6, 0, 8], [MediaSpan(1, 3, b"x")]) == 1  # not inside an item
