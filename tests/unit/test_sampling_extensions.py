"""vLLM's sampling extensions on the step-loop engines (the transformers thinker of the tiny
demo, driven directly): each field changes the reply as vLLM documents it, and where
transformers' own `generate` has the same knob, the reply equals its greedy output. (The same
fields against vLLM's own sampler: tests/integration/test_vllm.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import CallState, Engine, EngineCall, InvalidRequest
from omni_stage.segments import EngineOutput
from tests.unit.test_engines import engine_for, run

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
EOS = 97  # the tiny thinker's <|im_end|>
IM_START = 99


@pytest.fixture(scope="module")
def models(demo_dir: Path) -> Path:
    return demo_dir / "models"


@pytest.fixture(scope="module")
def thinker(models: Path) -> Engine:
    return engine_for("thinker", models)


def reply(
    engine: Engine, messages: list[dict[str, Any]] | None = None, **sampling: Any
) -> list[EngineOutput]:
    call = EngineCall(
        "r",
        {"request": {"messages": messages or MESSAGES}},
        True,
        Sampling.of({"max_tokens": 12, **sampling}),
    )
    return run(engine, call)


def ids(outs: list[EngineOutput]) -> list[int]:
    return [int(o.data["token_ids"][0]) for o in outs]


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


def test_ignore_eos_runs_to_max_tokens_and_min_tokens_holds_eos_back(thinker: Engine) -> None:
    """An end of sequence made certain (a logit bias of +100): the reply is that one token;
    with `ignore_eos` it runs to max_tokens; with `min_tokens` it ends right after that many."""
    eos_first = {"logit_bias": {str(EOS): 100.0}}
    assert ids(reply(thinker, **eos_first)) == [EOS]
    ignored = reply(thinker, ignore_eos=True, **eos_first)
    assert ids(ignored) == [EOS] * 12 and ignored[-1].finish_reason is None
    held = reply(thinker, min_tokens=5, **eos_first)
    assert len(held) == 6 and EOS not in ids(held)[:5] and ids(held)[5] == EOS
    assert held[-1].finish_reason == "stop"


def test_top_k_one_and_min_p_one_are_greedy(thinker: Engine) -> None:
    greedy = ids(reply(thinker))
    hot = {"temperature": 1.5, "seed": 7}
    assert ids(reply(thinker, **hot)) != greedy  # hot sampling alone wanders off
    assert ids(reply(thinker, top_k=1, **hot)) == greedy
    assert ids(reply(thinker, min_p=1.0, **hot)) == greedy
    # top_k -1 and 0 are vLLM's "every token": the same draw as without it.
    assert ids(reply(thinker, top_k=-1, **hot)) == ids(reply(thinker, **hot))


def test_top_k_and_min_p_sample_among_transformers_warpers_choices(thinker: Engine, models: Path) -> None:
    """Seeded samples at top_k 3 stay among the 3 likeliest tokens of each step (transformers'
    own scores, run step by step on the reply the engine made)."""
    outs = reply(thinker, temperature=1.0, top_k=3, seed=11, max_tokens=10)
    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    model = AutoModelForCausalLM.from_pretrained(models / "tiny-thinker")
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    seq = tok(prompt, add_special_tokens=False)["input_ids"]
    for t in ids(outs):
        with torch.inference_mode():
            logits = model(torch.tensor([seq])).logits[0, -1]
        assert t in torch.topk(logits, 3).indices.tolist()
        seq.append(t)


def test_repetition_penalty_equals_transformers_generate(thinker: Engine, models: Path) -> None:
    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    model = AutoModelForCausalLM.from_pretrained(models / "tiny-thinker")
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    input_ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    ref = model.generate(input_ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.8)
    ours = ids(reply(thinker, repetition_penalty=1.8, max_tokens=16))
    assert ours == ref[0, input_ids.shape[1] :].tolist() != ids(reply(thinker, max_tokens=16))


def test_stop_token_ids_allowed_token_ids_and_bad_words(thinker: Engine) -> None:
    greedy = reply(thinker)
    stop = ids(greedy)[4]
    stopped = reply(thinker, stop_token_ids=[stop])
    assert ids(stopped)[-1] == stop and stop not in ids(stopped)[:-1] and stopped[-1].finish_reason == "stop"
    allowed = [ord(c) - 31 for c in "abc"]  # the demo's byte-level ids: 'a' is 66
    assert set(ids(reply(thinker, allowed_token_ids=allowed))) <= set(allowed)
    word = text(greedy)[2]
    assert word not in text(reply(thinker, bad_words=[word])) and word in text(greedy)
    with pytest.raises(InvalidRequest, match="stop_token_ids: token 100 is not in the vocabulary"):
        reply(thinker, stop_token_ids=[100])
    with pytest.raises(InvalidRequest, match="allowed_token_ids: at least one token"):
        reply(thinker, allowed_token_ids=[])  # (the gateway refuses it first; any front end)


def test_stop_strings_special_tokens_and_spaces(thinker: Engine) -> None:
    full = text(reply(thinker, max_tokens=24))
    stop = full[8:10]
    assert full.find(stop) > 0, full
    kept = text(reply(thinker, max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert kept == full[: full.find(stop) + len(stop)]
    forced = {"allowed_token_ids": [IM_START, 66], "logit_bias": {str(IM_START): 50.0}, "max_tokens": 3}
    assert text(reply(thinker, **forced)) == ""  # special tokens are left out by default
    assert text(reply(thinker, skip_special_tokens=False, **forced)) == "<|im_start|>" * 3


def test_chat_template_arguments_and_truncation(thinker: Engine, models: Path) -> None:
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the chat
    template as vLLM passes them; truncate_prompt_tokens keeps the prompt's last tokens."""
    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")

    def prompt_tokens(messages: list[dict[str, Any]], **sampling: Any) -> int:
        state = CallState()
        call = EngineCall(
            "r", {"request": {"messages": messages}}, True, Sampling.of({"max_tokens": 1, **sampling}), state
        )
        run(thinker, call)
        return state.prompt_tokens

    def template(messages: list[dict[str, Any]], **kwargs: Any) -> int:
        return len(
            tok(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)[
                "input_ids"
            ]
        )

    partial = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    assert prompt_tokens(MESSAGES) == template(MESSAGES, add_generation_prompt=True)
    assert prompt_tokens(MESSAGES, add_generation_prompt=False) == template(
        MESSAGES, add_generation_prompt=False
    )
    assert prompt_tokens(partial, continue_final_message=True) == template(
        partial, continue_final_message=True
    )
    assert prompt_tokens(MESSAGES, truncate_prompt_tokens=5) == 5
    # A variable only this request's template reads: Qwen's templates read none, so the count is
    # the same, and an unknown one is not an error (as in vLLM).
    assert prompt_tokens(MESSAGES, chat_template_kwargs={"enable_thinking": False}) == prompt_tokens(MESSAGES)
    with pytest.raises(InvalidRequest, match="continue_final_message: cannot go with add_generation_prompt"):
        reply(thinker, partial, continue_final_message=True, add_generation_prompt=True)


def test_structured_outputs_regex_choice_and_grammar(thinker: Engine) -> None:
    regex = reply(thinker, structured_outputs={"regex": "[a-c]{3}x"}, max_tokens=8)
    assert re.fullmatch("[a-c]{3}x", text(regex)) and regex[-1].finish_reason == "stop"
    choice = text(reply(thinker, structured_outputs={"choice": ["yes", "no", "maybe"]}))
    assert choice in {"yes", "no", "maybe"}
    grammar = text(
        reply(thinker, structured_outputs={"grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, max_tokens=8)
    )
    assert re.fullmatch(r"\(\d\d?\)", grammar), grammar
    with pytest.raises(InvalidRequest, match="structured_outputs: the regex cannot be used"):
        reply(thinker, structured_outputs={"regex": "(unclosed"})


def test_constraints_that_leave_no_next_token_are_the_clients_error(thinker: Engine) -> None:
    """A choice that can only end at once (the empty string) with min_tokens holding the end
    back: no token may come next, a 400, not a pick the grammar then refuses (a 500). Found by
    tests/integration/test_gateway_schema.py's fuzzing."""
    with pytest.raises(InvalidRequest, match="leave no token that may come next"):
        reply(thinker, structured_outputs={"choice": [""]}, min_tokens=2)
    with pytest.raises(InvalidRequest, match="leave no token that may come next"):
        reply(thinker, allowed_token_ids=[EOS], min_tokens=1)


def test_a_reply_that_goes_past_its_grammars_end_runs_on_unconstrained(thinker: Engine) -> None:
    """`ignore_eos` and a choice: the reply is the choice, the end of sequence the grammar then
    takes (its stop token), and on to max_tokens unconstrained, as vLLM runs it, not a 500 from
    a grammar asked for a token after its end. Found by tests/integration/test_gateway_schema.py's
    fuzzing (a choice of "" under ignore_eos)."""
    for choice in ("yes", ""):
        out = reply(thinker, structured_outputs={"choice": [choice]}, ignore_eos=True, max_tokens=6)
        assert len(out) == 6 and out[-1].finish_reason is None
        assert text(out).startswith(choice) and EOS in ids(out)


def test_a_vanishing_repetition_penalty_still_draws_what_the_grammar_allows(thinker: Engine) -> None:
    """repetition_penalty 1e-40 (tiny, but not 0 in float32) divides a seen token's positive
    logit to +inf: the draw is among those tokens (the limit), never a NaN's token 0 that the
    grammar refuses; 5e-324, which float32 makes 0, is refused. (A 500 before, found by
    tests/integration/test_gateway_schema.py's fuzzing.)"""
    choice = {"choice": ["yes", "no"]}
    out = reply(thinker, structured_outputs=choice, repetition_penalty=1e-40)
    assert text(out) in {"yes", "no"}
    with pytest.raises(InvalidRequest, match="repetition_penalty: 5e-324 must be above 0"):
        reply(thinker, structured_outputs=choice, repetition_penalty=5e-324)


def test_prompt_logprobs_are_the_models_over_the_prompt(thinker: Engine, models: Path) -> None:
    """vLLM's `prompt_logprobs`: at each prompt position after the first, the prompt token's log
    probability under transformers' own forward of the prompt, its rank, and the k likeliest."""
    state = CallState()
    run(
        thinker,
        EngineCall(
            "r", {"request": {"messages": MESSAGES}}, True, Sampling(max_tokens=2, prompt_logprobs=2), state
        ),
    )
    got = state.prompt_logprobs
    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    model = AutoModelForCausalLM.from_pretrained(models / "tiny-thinker")
    prompt = tok(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    ids = prompt["input_ids"]
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert got is not None and len(got) == len(ids) and got[0] is None
    for i, at in enumerate(got[1:]):
        assert at is not None and at[0].token_id == ids[i + 1] and at[0].token == tok.decode([ids[i + 1]])
        assert at[0].logprob == pytest.approx(float(lp[i, ids[i + 1]]), abs=1e-5)
        assert at[0].rank == int((lp[i] > lp[i, ids[i + 1]]).sum()) + 1
        best = torch.topk(lp[i], 2).indices.tolist()
        assert [p.token_id for p in at[1:]] == [t for t in best if t != ids[i + 1]]
