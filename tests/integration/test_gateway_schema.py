"""Property-based tests of the gateway against its own OpenAPI schema (schemathesis), with real
stages behind it on a real nats-server: whatever a client sends, valid by the schema or not,
the answer is never a server error. Twice: behind a synthetic stage with small limits, and
behind the tiny demo's real models (thinker -> talker -> vocoder) with the default body limit
(16 MiB, past NATS's 1 MiB message cap), where what a real tokenizer and model make of the
inputs is part of the answer. Then the edge values that found real 500s before, each a clear
OpenAI-style 400 naming the field.

(schemathesis's pytest plugin does not run on pytest 9, so each operation's strategy is
driven through hypothesis directly; the cases and the check are schemathesis's own.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from omni_cli.natsd import EmbeddedNats
from tests.deployment import deployed
from tests.helpers import HTTP, ROOT

PIPELINE = ROOT / "tests" / "data" / "echo.yaml"
REAL_PIPELINE = ROOT / "tests" / "data" / "tiny-omni-api.yaml"
EXAMPLES = {
    ("echo", schemathesis.GenerationMode.POSITIVE): 60,
    ("echo", schemathesis.GenerationMode.NEGATIVE): 30,
    ("real", schemathesis.GenerationMode.POSITIVE): 30,
    ("real", schemathesis.GenerationMode.NEGATIVE): 30,
}
"""Per operation and mode; fewer behind real models, whose answers take a forward pass each,
and fewer invalid requests than valid ones: each costs hypothesis several times a valid one's
generation, and is refused at validation before anything behind it runs. Hypothesis draws new
examples every run (no database, not derandomised), so the runs together cover what one long
run would: at twice these, the module took 82 s of the suite's CPU, 68 of them generating."""
PARTS = 3
"""The operations are fuzzed in this many tests, each taking every third (each a minute or
more under load, were they one)."""
SERVED = {"echo": "echo", "real": "tiny-omni"}
STAGES = {"echo": ["echo"], "real": ["thinker", "talker", "vocoder"]}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("schema")
    nats = EmbeddedNats()
    try:
        with deployed(PIPELINE, {"echo": 1}, 1, nats.url, ROOT, logs) as d:
            yield d.base
    finally:
        nats.stop()


@pytest.fixture(scope="module")
def real_gateway(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("schema-real")
    nats = EmbeddedNats()
    layout = {"thinker": 1, "talker": 1, "vocoder": 1}
    try:
        with deployed(REAL_PIPELINE, layout, 1, nats.url, demo_dir, logs) as d:
            yield d.base
    finally:
        nats.stop()


def _operations(base: str) -> dict[str, schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in ops}


def test_the_schema_covers_the_api(gateway: str) -> None:
    ops = set(_operations(gateway))
    assert {"POST /v1/chat/completions", "POST /v1/images/generations", "POST /v1/audio/speech"} <= ops
    assert {"GET /v1/models", "GET /health"} <= ops


@pytest.mark.parametrize("part", range(PARTS), ids=lambda p: f"part{p}")
@pytest.mark.parametrize("behind", ["echo", "real"])
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_no_input_makes_a_server_error(
    request: pytest.FixtureRequest, behind: str, mode: schemathesis.GenerationMode, part: int
) -> None:
    gateway: str = request.getfixturevalue("gateway" if behind == "echo" else "real_gateway")
    for name, op in sorted(_operations(gateway).items())[part::PARTS]:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES[behind, mode],
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def never_a_server_error(case: schemathesis.Case) -> None:
            if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = SERVED[behind]  # else most valid requests stop at a 404
            response = case.call(base_url=gateway, timeout=30)
            if case.path.startswith("/v1/omni/"):  # a sleep it made must not change what follows
                wake = HTTP.post(f"{gateway}/v1/omni/wakeup", json={"stage_ids": STAGES[behind]}, timeout=60)
                assert wake.status_code == 200, wake.text
            case.validate_response(response, checks=[not_a_server_error])

        try:
            never_a_server_error()
        except Unsatisfiable:
            assert mode is schemathesis.GenerationMode.NEGATIVE, name  # nothing to negate (no input)
        except Exception as exc:
            raise AssertionError(f"{name}: {exc}") from exc


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"seed": 2**70}, "seed", "less than 9223372036854775808"),
        ({"max_tokens": 65}, "max_tokens", "65 is more than this model's limit of 64"),
        ({"max_completion_tokens": 2**70}, "max_completion_tokens", "limit of 64"),
        (
            {"messages": [{"role": "user", "content": [{"type": "file", "n": 2**80}]}]},
            "messages[0].content[0]",
            "'file' parts are not served",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            "must be a data: URL or http(s)",
        ),
        (
            {"modalities": ["audio"], "audio": {"voice": "alloy"}},
            "modalities",
            "cannot output audio; it outputs text",
        ),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"n": 17}, "n", "less than or equal to 16"),
        # What the echo stage's (synthetic) engine does not declare it honours.
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not honoured by stage 'echo' (synthetic)"),
        ({"logprobs": True}, "logprobs", "not honoured by stage 'echo' (synthetic)"),
        ({"temperature": 0.7, "seed": 1}, "seed", "not honoured by stage 'echo' (synthetic)"),
        ({"top_logprobs": 2}, "top_logprobs", "needs `logprobs: true`"),
        ({"logit_bias": {"x": 1}}, "logit_bias.x.[key]", "should match pattern"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"presence_penalty": -2.5}, "presence_penalty", "greater than or equal to -2"),
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            "not honoured by stage 'echo' (synthetic)",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "goes with, and only with"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "description": "x"}}},
            "response_format.json_schema.description",
            "not served",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
            "not honoured by stage 'echo' (synthetic)",
        ),
        ({"tool_choice": "required"}, None, "other than none or auto needs `tools`"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "'function'"),
        ({"top_k": 5}, "top_k", "not honoured by stage 'echo' (synthetic)"),
        (
            {"messages": [*USER, {"role": "assistant", "content": "no", "refusal": "I won't"}]},
            "messages.1.refusal",
            "not served by this server",
        ),
        (
            {"stream_options": {"include_continuous_usage": True}},  # vLLM's name is continuous_usage_stats
            "stream_options.include_continuous_usage",
            "unrecognized",
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
        (
            {"sampling_params_list": [{"allowed_token_ids": []}]},  # found by the fuzzing above as a 500
            "sampling_params_list.0.allowed_token_ids",
            "at least 1 item",
        ),
    ],
    ids=[
        "huge-seed",
        "too-many-tokens",
        "huge-max-tokens",
        "file-part",
        "bad-url",
        "unknown-modality",
        "hot",
        "n",
        "penalty",
        "logprobs",
        "seed",
        "top-logprobs-alone",
        "bias-key",
        "bias-value",
        "penalty-range",
        "json-mode",
        "json-schema-without-one",
        "json-schema-description",
        "tools",
        "tool-choice-without-tools",
        "custom-tool",
        "unknown-field",
        "refusal-in-history",
        "unknown-stream-option",
        "no-allowed-token",
        "no-allowed-token-for-a-stage",
    ],
)
def test_edge_values_are_client_errors(
    gateway: str, body: dict[str, object], param: str | None, says: str
) -> None:
    r = HTTP.post(f"{gateway}/v1/chat/completions", json={"model": "echo", "messages": USER, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_non_json_numbers_are_client_errors(gateway: str) -> None:
    body = b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    r = HTTP.post(
        f"{gateway}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_platform_fields_and_fields_at_off_are_accepted(gateway: str) -> None:
    """OpenAI's platform fields (ignored, documented), unserved fields at the value that turns
    them off, and an assistant turn sent back as the openai client dumps it."""
    earlier = {"role": "assistant", "content": "x", "refusal": None, "tool_calls": None, "audio": None}
    body = {
        "model": "echo",
        "messages": [*USER, earlier, *USER],
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "service_tier": "auto",
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logprobs": False,
        "logit_bias": {},
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
    }
    r = HTTP.post(f"{gateway}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 2**70}, {"s": "\ud800"}],
    ids=["number-past-64-bits", "lone-surrogate"],
)
def test_tokenize_template_variables_that_cannot_travel_are_400s(
    real_gateway: str, kwargs: dict[str, object]
) -> None:
    """/tokenize's `chat_template_kwargs` go to the stage as they are: what cannot be sent on
    (found by the fuzzing above as a 500) is the client's error."""
    body = json.dumps(
        {"model": "tiny-omni", "messages": USER, "chat_template_kwargs": kwargs}, ensure_ascii=True
    )
    r = HTTP.post(f"{real_gateway}/tokenize", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "cannot be sent on" in err["message"], err


def test_a_tokenize_request_past_a_nats_message_is_a_413(real_gateway: str) -> None:
    """/tokenize asks the stage in one NATS message: a prompt past NATS's 1 MiB is refused by
    name, not a 500."""
    r = HTTP.post(f"{real_gateway}/tokenize", json={"model": "tiny-omni", "prompt": "word " * 300_000})
    assert r.status_code == 413, r.text
    assert "over the server's limit" in r.json()["error"]["message"]
