"""`omni serve` end to end, as a user runs it: the official openai client against the real
process tree (embedded nats-server, one process per stage, the gateway)."""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import re
import signal
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import soundfile as sf
import yaml

from tests.deployment import gauges, metric_values, metrics_urls, settle
from tests.helpers import (
    HTTP,
    REFUSED_CHAT,
    ROOT,
    WEATHER,
    OmniProcess,
    assert_all_gone,
    decode_wav,
    get_json,
    openai_client,
    replica_metric,
    replicas,
    served,
    served_example,
    sse_data,
    vllm_bench_serve,
    vllm_omni_client,
    wait_for,
    wait_group_gone,
)
from tests.openai_schema import violations

pytestmark = pytest.mark.slow

SLOW = ROOT / "tests" / "data" / "slow-synthetic.yaml"


def audio_delta(chunk: object) -> dict[str, object] | None:
    """The `delta.audio` of a streamed chunk, typed or not depending on the openai version."""
    choices = getattr(chunk, "choices", None)
    if not choices:
        return None
    delta = choices[0].delta
    a = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
    if a is None:
        return None
    return a if isinstance(a, dict) else a.model_dump()


@pytest.fixture(scope="module")
def demo_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def demo(demo_dir: Path, demo_logs: Path) -> Iterator[str]:
    with served_example("tiny-omni.yaml", demo_dir, demo_logs) as base:
        yield base


def test_text_and_audio(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    r = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Hello!"}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    msg = r.choices[0].message
    assert msg.content and r.usage is not None and r.usage.completion_tokens == 32
    assert msg.audio is not None and msg.audio.transcript == msg.content and msg.audio.expires_at > 0
    samples, sr = decode_wav(msg.audio.data)
    assert sr == 24000 and len(samples) > 0
    # 32 thinker tokens -> 4 codes each -> 480 samples per code
    assert len(samples) == 32 * 4 * 480


def test_streaming_text_and_audio_chunks(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Tell me a story"}],
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        stream_options={"include_usage": True},
    )
    kinds: list[str] = []
    wavs: list[bytes] = []
    for chunk in stream:
        if not chunk.choices:
            kinds.append("usage")
            continue
        delta = chunk.choices[0].delta
        if (a := audio_delta(chunk)) is not None:
            assert (chunk.model_extra or {})["modality"] == "audio"
            kinds.append("audio")
            wavs.append(base64.b64decode(a["data"]))
        elif delta.content:
            kinds.append("text")
        if chunk.choices[0].finish_reason:
            kinds.append("finish")
    assert kinds.index("text") < kinds.index("finish")
    assert kinds[: kinds.index("finish")].count("audio") >= 2
    assert kinds[-1] == "usage"
    # Each chunk a WAV file of its own (as vLLM-Omni streams them): decoded one by one, their
    # samples are the whole answer's.
    assert sum(len(sf.read(io.BytesIO(w))[0]) for w in wavs) == 32 * 4 * 480
    assert {sf.info(io.BytesIO(w)).samplerate for w in wavs} == {24000}


def _stream(demo: str, **body: Any) -> list[dict[str, Any]]:
    chat = {
        "model": "tiny-omni",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "modalities": ["text", "audio"],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        **body,
    }
    r = HTTP.post(f"{demo}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    return sse_data(r.text)


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["modality"] == "text" and c["choices"]
    )


def test_vllm_omni_stream_shape_and_continuous_usage(demo: str) -> None:
    """A request for audio that names no `audio` (as vLLM-Omni's clients send it) is streamed as
    vLLM-Omni streams: every chunk tagged with its `modality`, each audio chunk a whole WAV file
    in `delta.content`, in the default voice. The same reply as OpenAI's shape (PCM16 in
    `delta.audio`), text and samples alike. With continuous_usage_stats every chunk carries the
    usage so far. Read raw here; the next tests read it with vLLM-Omni's own
    client."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    omni = _stream(demo, stream_options=usage)
    openai_shape = _stream(demo, audio={"voice": "alloy", "format": "pcm16"})
    assert {c["modality"] for c in omni} == {"text", "audio"} == {c["modality"] for c in openai_shape}
    assert _text(omni) == _text(openai_shape) and _text(omni)

    audio = [c for c in omni if c["modality"] == "audio" and c["choices"][0]["delta"]]  # not the finish
    wavs = [base64.b64decode(c["choices"][0]["delta"]["content"]) for c in audio]
    assert len(wavs) >= 2 and all("audio" not in c["choices"][0]["delta"] for c in omni if c["choices"])
    pcm = b""
    for data in wavs:  # each chunk is a file of its own, as vLLM-Omni's benchmark reads them
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
            pcm += w.readframes(w.getnframes())
    deltas = [
        c["choices"][0]["delta"]["audio"]
        for c in openai_shape
        if c["choices"] and "audio" in c["choices"][0]["delta"]
    ]
    assert pcm == b"".join(base64.b64decode(a["data"]) for a in deltas) and len(pcm) == 2 * 8 * 4 * 480

    assert all("usage" in c for c in omni) and all("usage" not in c for c in openai_shape)
    done = [c["usage"]["completion_tokens"] for c in omni]
    assert done == sorted(done) and done[-1] == 8 and done[0] == 0  # the role chunk: none yet
    text_chunks = [
        c
        for c in omni
        if c["modality"] == "text" and c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    # The demo's byte-level tokens are one character each: a chunk's count is the text so far.
    # (How the thinker cuts its segments depends on time as well as size: not asserted.)
    sent = [
        len("".join(c["choices"][0]["delta"]["content"] for c in text_chunks[: i + 1]))
        for i in range(len(text_chunks))
    ]
    assert [c["usage"]["completion_tokens"] for c in text_chunks] == sent and sent[-1] == 8
    prompt = omni[-1]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"]["prompt_tokens"] == prompt for c in text_chunks)
    assert omni[-1]["choices"] == [] and omni[-1]["usage"]["total_tokens"] == prompt + 8


def test_vllm_omni_shape_through_the_openai_client(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "Tell me a story"}],
        modalities=["text", "audio"],
        max_tokens=8,
        stream=True,
    )
    audio = 0
    for chunk in stream:
        modality = (chunk.model_extra or {})["modality"]
        if modality == "audio" and chunk.choices[0].delta.content:  # the finish chunk has none
            with wave.open(io.BytesIO(base64.b64decode(chunk.choices[0].delta.content or ""))) as w:
                audio += w.getnframes()
    assert audio == 8 * 4 * 480


def test_vllm_omni_benchmark_client_measures_text_and_audio(demo: str) -> None:
    """vLLM-Omni's own benchmark request function (`vllm bench serve --omni --backend
    openai-chat-omni`) reads our stream: time to first token, audio time to first packet and
    audio real-time factor, all of the audio, no warning; in vLLM-Omni's shape (no `audio`
    named) and in OpenAI's with format wav (each chunk a WAV of its own, as it reads them)."""
    runs = vllm_omni_client(demo, "tiny-omni", 3, 16, [{}, {"audio": {"voice": "alloy", "format": "wav"}}])
    assert len(runs) == 2
    for got in runs:
        assert got["warnings"] == [], got["warnings"]
        for r in got["requests"]:
            assert r["success"] and r["generated_text"] and r["output_tokens"] == 16, r
            assert 0 < r["ttft"] < r["latency"] and r["audio_ttfp"] > 0 and r["audio_rtf"] > 0, r
            assert r["audio_duration"] == 16 * 4 * 480 / 24000, r


def test_vllm_omni_cli_runs_against_the_demo_as_its_users_run_it(
    demo: str, demo_dir: Path, tmp_path: Path
) -> None:
    """`vllm bench serve --omni --backend openai-chat-omni`, vLLM-Omni's own console entry
    point from its own virtualenv, with TPOT and ITL asked for (so it sends
    `return_stage_metrics`), `--ignore-eos`, and its /tokenize alignment: every request
    succeeds, text comes well before the end, tokens come apart, audio plays faster than real
    time."""
    tokenizer = demo_dir / "models" / "tiny-thinker"
    result = vllm_bench_serve(demo, "tiny-omni", tokenizer, tmp_path, prompts=10, concurrency=2)
    assert result["completed"] == 10 and result["failed"] == 0, result["errors"]
    assert 0 < result["mean_ttft_ms"] < 0.7 * result["mean_e2el_ms"], result
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0, result
    assert result["mean_audio_ttfp_ms"] > 0 and 0 < result["mean_audio_rtf"] < 1, result
    assert result["total_output_tokens"] == 10 * 16 and "tokenize unavailable" not in result["log"]


def test_vllm_dialect_through_the_openai_client(demo: str) -> None:
    """vLLM's extensions ride in the openai SDK's `extra_body`, as vLLM's users send them, and
    change the reply as they say (each is checked engine by engine in
    tests/unit/test_sampling_extensions.py); vLLM-Omni's own fields too."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Tell me a story"}]

    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(
            model="tiny-omni", messages=messages, max_tokens=12, extra_body=extra
        )

    greedy = ask().choices[0].message.content
    assert ask(temperature=1.5, seed=3, top_k=1).choices[0].message.content == greedy
    forced_eos = {"logit_bias": {"97": 100}}
    assert ask(**forced_eos).usage.completion_tokens == 1
    assert ask(ignore_eos=True, **forced_eos).usage.completion_tokens == 12
    assert ask(min_tokens=5, **forced_eos).usage.completion_tokens == 6

    r = ask(request_id="my-id-1", return_stage_metrics=True)
    assert r.id == "chatcmpl-my-id-1"
    stage0 = (r.model_extra or {})["metrics"]["stage_metrics"]["0"]
    assert (
        stage0["stage"] == "thinker"
        and stage0["num_tokens_out"] == 12
        and stage0["final_output_type"] == "text"
    )
    assert stage0["num_tokens_in"] == r.usage.prompt_tokens and stage0["stage_gen_time_ms"] > 0

    with_prompt = ask(prompt_logprobs=1)
    prompt = (with_prompt.model_extra or {})["prompt_logprobs"]
    assert len(prompt) == with_prompt.usage.prompt_tokens and prompt[0] is None
    assert all(
        1 <= len(at) <= 2 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in at.values())
        for at in prompt[1:]
    )
    with pytest.raises(openai.BadRequestError, match="not available when `stream` is true"):
        client.chat.completions.create(
            model="tiny-omni", messages=messages, stream=True, extra_body={"prompt_logprobs": 1}
        )

    # echo with a reply that continues the assistant's own turn: the turn's text comes first.
    messages = [*messages, {"role": "assistant", "content": "Once upon"}]
    cont = ask(echo=True, continue_final_message=True, add_generation_prompt=False).choices[0].message.content
    assert cont.startswith("Once upon") and len(cont) > len("Once upon")


def test_stage_metrics_and_sampling_per_stage_with_audio(demo: str) -> None:
    """`return_stage_metrics` on the streamed finish and the whole response, one entry per
    stage in pipeline order; `sampling_params_list` reaches one stage alone (the talker's
    temperature changes the speech, not the thinker's text); a field a stage does not honour
    is a 400 naming the entry, the field and the stage."""
    body = {
        "model": "tiny-omni",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "modalities": ["text", "audio"],
        "max_tokens": 8,
        "return_stage_metrics": True,
    }
    url = f"{demo}/v1/chat/completions"
    whole = HTTP.post(url, json=body, timeout=60).json()
    stages = whole["metrics"]["stage_metrics"]
    assert [stages[i]["stage"] for i in ("0", "1", "2")] == ["thinker", "talker", "vocoder"]
    assert stages["1"]["num_tokens_in"] == 0 and stages["1"]["num_tokens_out"] == 8 * 4
    assert stages["2"]["final_output_type"] == "audio" and stages["2"]["serving_time_to_first_output_ms"] > 0
    streamed = sse_data(HTTP.post(url, json={**body, "stream": True}, timeout=60).text)
    finish = [c for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and set(finish[0]["metrics"]["stage_metrics"]) == {"0", "1", "2"}

    plain = HTTP.post(url, json=body, timeout=60).json()["choices"][0]["message"]["audio"]["data"]
    talker_hot = {**body, "sampling_params_list": [None, {"temperature": 1.0, "seed": 5}]}
    hot = HTTP.post(url, json=talker_hot, timeout=60).json()["choices"][0]["message"]
    assert hot["content"] == whole["choices"][0]["message"]["content"] and hot["audio"]["data"] != plain
    for entries, param, says in (
        (
            [None, None, {"temperature": 1.0}],
            "sampling_params_list.2.temperature",
            "stage 'vocoder' (torch)",
        ),
        ([{"best_of": 2}], "sampling_params_list.0.best_of", "unrecognized request argument"),
        ([None] * 4, "sampling_params_list", "4 entries for 3 stages"),
    ):
        r = HTTP.post(url, json={**body, "sampling_params_list": entries}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.text, r.text


def test_tokenize_and_detokenize_as_vllms(demo: str) -> None:
    """vLLM's /tokenize and /detokenize, with the thinker's own tokenizer and chat template:
    the ids a chat request's prompt is, as its usage counts them."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = HTTP.post(f"{demo}/tokenize", json={"model": "tiny-omni", "messages": messages}, timeout=30).json()
    r = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused").chat.completions.create(
        model="tiny-omni",
        messages=messages,
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert set(chat) == {"count", "max_model_len", "tokens", "token_strs"} and chat["token_strs"] is None
    assert chat["count"] == len(chat["tokens"]) == r.usage.prompt_tokens and chat["max_model_len"] == 4096
    plain = HTTP.post(
        f"{demo}/tokenize", json={"prompt": "Hello", "return_token_strs": True}, timeout=30
    ).json()
    assert plain["token_strs"] == ["H", "e", "l", "l", "o"]
    back = HTTP.post(f"{demo}/detokenize", json={"model": "tiny-omni", "tokens": plain["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "Hello"}
    for path, payload, says in (
        ("/detokenize", {"tokens": [100]}, "100 is not in the vocabulary"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model 'other' does not exist"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "counts text parts only",
        ),
    ):
        got = HTTP.post(f"{demo}{path}", json=payload, timeout=30)
        assert got.status_code in (400, 404) and says in got.text, got.text


def test_each_replica_says_where_its_time_goes(demo: str) -> None:
    """What `omni bench qwen-omni` reads of each stage: its compute thread's busy seconds, its
    batched calls and the pieces in them, each request's wait from admission to start, each
    engine call, and the time spent (de)serialising frames. Four concurrent requests: each
    counter moves, and the engine calls and waits are counted per request."""

    def read(stage: str) -> dict[str, float]:
        names = (
            "omni_engine_compute_seconds_total",
            "omni_engine_batches_total",
            "omni_engine_batched_items_total",
            "omni_stage_queue_wait_seconds_count",
            "omni_stage_engine_call_seconds_count",
            "omni_wire_seconds_total",
        )
        return {n: replica_metric(demo, stage, n) for n in names}

    stages = ("thinker", "talker", "vocoder")
    before = {s: read(s) for s in stages}
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")

    def ask(i: int) -> None:
        client.chat.completions.create(
            model="tiny-omni",
            messages=[{"role": "user", "content": f"Tell me story {i}"}],
            modalities=["text", "audio"],
            max_tokens=8,
        )

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(4)))
    for stage in stages:
        now = read(stage)
        moved = {k: now[k] - before[stage][k] for k in now}
        assert moved["omni_engine_compute_seconds_total"] > 0, (stage, moved)
        assert moved["omni_stage_queue_wait_seconds_count"] == 4, (stage, moved)
        assert moved["omni_stage_engine_call_seconds_count"] >= 4, (stage, moved)
        assert moved["omni_engine_batched_items_total"] >= moved["omni_engine_batches_total"] > 0, (
            stage,
            moved,
        )
        assert moved["omni_wire_seconds_total"] > 0, (stage, moved)


def test_voices_are_listed_and_honoured(demo: str) -> None:
    r = HTTP.get(f"{demo}/v1/audio/voices")
    assert r.status_code == 200 and r.json() == {"voices": ["alloy", "echo"], "uploaded_voices": []}
    speech = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused").audio.speech
    alloy = speech.create(model="tiny-omni", input="Hello there", voice="alloy", response_format="pcm")
    echo = speech.create(model="tiny-omni", input="Hello there", voice="echo", response_format="pcm")
    default = HTTP.post(
        f"{demo}/v1/audio/speech",
        json={"model": "tiny-omni", "input": "Hello there", "response_format": "pcm"},
        timeout=60,
    )
    assert len(alloy.content) == len(echo.content) == 2 * SPOKEN and alloy.content != echo.content
    assert default.content == alloy.content  # the vocoder's default: its first voice


def test_text_only_and_models(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    r = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert r.choices[0].message.audio is None and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5
    [model] = client.models.list().data
    assert model.id == "tiny-omni" and (model.model_extra or {})["modalities"] == ["audio", "text"]


def test_logprobs_logit_bias_and_penalties_through_the_openai_client(demo: str, demo_dir: Path) -> None:
    """The thinker's engine declares it honours them (and `stop`), so the gateway passes them
    on; each shows its effect on a greedy reply (the sampler itself is checked against
    transformers and vLLM in tests/unit/test_engines.py and tests/integration/test_vllm.py)."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Tell me a story"}]

    def ask(**extra: Any) -> Any:
        return client.chat.completions.create(model="tiny-omni", messages=messages, max_tokens=16, **extra)

    plain = ask(logprobs=True, top_logprobs=2)
    content, lp = plain.choices[0].message.content, plain.choices[0].logprobs.content
    assert len(lp) == 16 and "".join(t.token for t in lp) == content
    for t in lp:  # greedy: each token is its position's most likely, and bytes are its UTF-8
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob <= 0 and bytes(t.bytes or []) == t.token.encode()
    streamed = [
        t
        for c in ask(logprobs=True, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lp]
    assert ask().choices[0].logprobs is None

    stop = content[5:7]  # `stop`: the reply ends before the first stop string
    stopped = ask(stop=["never", stop])
    assert stopped.choices[0].message.content == content[: content.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(demo_dir / "models" / "tiny-thinker")
    favourite = next(
        t for t in range(vocab.vocab_size) if (v := vocab.decode([t])).isalpha() and v not in content
    )
    biased = ask(logit_bias={str(favourite): 100})
    with pytest.raises(openai.BadRequestError, match="logit_bias: token 100000 is not in the vocabulary"):
        ask(logit_bias={"100000": 1})
    assert biased.choices[0].message.content == vocab.decode([favourite]) * 16

    # A penalty lowers only tokens the reply has used: greedy is unchanged until the plain
    # reply first repeats a token, and there the penalised one says something else.
    tokens = [t.token for t in lp]
    first_repeat = next(i for i, t in enumerate(tokens) if t in tokens[:i])
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = [t.token for t in ask(logprobs=True, **penalty).choices[0].logprobs.content]
        assert penalised[:first_repeat] == tokens[:first_repeat], penalty
        assert penalised[first_repeat] != tokens[first_repeat], penalty


def test_n_replies_are_the_seeded_replies_side_by_side(demo: str) -> None:
    """`n` replies: reply i is what one request seeded with seed + i answers (vLLM's own rule
    for its child requests, tests/integration/test_vllm.py), whole and streamed, with the
    prompt counted once in usage; each reply of a spoken request has its own audio."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Tell me a story"}]
    sampled: Any = {"model": "tiny-omni", "messages": messages, "max_tokens": 12, "temperature": 1.0}
    r = client.chat.completions.create(**sampled, n=3, seed=5)
    alone = [
        client.chat.completions.create(**sampled, seed=5 + i).choices[0].message.content for i in range(3)
    ]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == alone and len(set(alone)) == 3
    assert r.usage is not None and r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == client.chat.completions.create(**sampled, seed=5).usage.prompt_tokens  # type: ignore[union-attr]

    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finished, usage = [], None
    for c in client.chat.completions.create(
        **sampled, n=3, seed=5, stream=True, stream_options={"include_usage": True}
    ):
        if not c.choices:
            usage = c.usage
            continue
        text[c.choices[0].index] += c.choices[0].delta.content or ""
        if c.choices[0].finish_reason:
            finished.append(c.choices[0].index)
    assert [text[i] for i in range(3)] == alone and sorted(finished) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == 36

    spoken = client.chat.completions.create(
        model="tiny-omni",
        messages=messages,
        n=2,
        max_tokens=8,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    for c in spoken.choices:  # greedy: the same reply twice, each spoken
        assert c.message.content == spoken.choices[0].message.content and c.message.audio is not None
        assert len(decode_wav(c.message.audio.data)[0]) == 8 * 4 * 480


def test_json_mode_through_the_openai_client(demo: str) -> None:
    """`response_format` constrains the thinker's decoding to the schema (xgrammar, as vLLM);
    the reply parses and validates. (This prompt's greedy reply closes within the budget.)"""
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Give me JSON"}]
    r = client.chat.completions.create(
        model="tiny-omni",
        messages=messages,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    r = client.chat.completions.create(
        model="tiny-omni", messages=messages, max_tokens=64, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    bad: Any = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}}
    with pytest.raises(
        openai.BadRequestError, match="response_format: the schema cannot be used: Type should"
    ):
        client.chat.completions.create(model="tiny-omni", messages=messages, response_format=bad)


def test_tool_calls_through_the_openai_client(demo: str) -> None:
    """A named or required tool choice comes back as `tool_calls` (whole and streamed, as OpenAI
    streams them), arguments valid against the tool's parameters; a follow-up turn with the
    call and its result is taken. `auto` needs the model's tool parser, which the demo's engine
    does not name: a 400 that says so; tools with a spoken reply are a 400."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Weather?"}]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny-omni", messages=messages, max_tokens=64, tools=[WEATHER], tool_choice=named
    )
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(
        model="tiny-omni", messages=messages, max_tokens=64, tools=[WEATHER], tool_choice=named, stream=True
    )
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].delta.tool_calls
        for t in c.choices[0].delta.tool_calls
    ]
    # As OpenAI streams a call: the first fragment names it, the rest extend its arguments.
    assert streamed[0].id and streamed[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert len(streamed) > 1 and {t.index for t in streamed} == {0}
    assert all(t.id is None and t.function.name is None for t in streamed[1:])  # type: ignore[union-attr]
    assert "".join(t.function.arguments or "" for t in streamed) == call.function.arguments  # type: ignore[union-attr]

    r = client.chat.completions.create(
        model="tiny-omni", messages=messages, max_tokens=250, tools=[WEATHER], tool_choice="required"
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    follow_up: Any = [
        *messages,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model="tiny-omni", messages=follow_up, max_tokens=4, tools=[WEATHER], tool_choice="none"
    )
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls

    with pytest.raises(openai.BadRequestError, match="'auto' needs the model's tool call parser"):
        client.chat.completions.create(model="tiny-omni", messages=messages, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="a spoken reply cannot carry tool calls"):
        client.chat.completions.create(
            model="tiny-omni",
            messages=messages,
            tools=[WEATHER],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )


SPOKEN = 32 * 4 * 480  # samples: 32 thinker tokens -> 4 codes each -> 480 samples per code


def test_speech_wav_pcm_and_speed(demo: str) -> None:
    speech = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused").audio.speech.with_raw_response
    wav = speech.create(model="tiny-omni", input="Hello there", voice="alloy", response_format="wav")
    samples, rate = sf.read(io.BytesIO(wav.content))
    assert rate == 24000 and len(samples) == SPOKEN
    assert wav.headers["content-type"] == "audio/wav" and wav.headers["x-sample-rate"] == "24000"
    pcm = speech.create(model="tiny-omni", input="Hello there", voice="alloy", response_format="pcm")
    assert pcm.headers["content-type"] == "audio/pcm" and len(pcm.content) == 2 * SPOKEN
    fast = speech.create(model="tiny-omni", input="Hello there", voice={"id": "alloy"}, speed=2.0)
    faster, _ = sf.read(io.BytesIO(fast.content))
    assert 0.45 * SPOKEN < len(faster) < 0.55 * SPOKEN  # each window of 25 codes spoken as 12


def test_speech_as_sse_events(demo: str) -> None:
    body = {"model": "tiny-omni", "input": "Hi", "voice": "alloy", "stream_format": "sse"}
    r = HTTP.post(f"{demo}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"] and len(events) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    samples, rate = sf.read(io.BytesIO(audio))  # the deltas make the WAV file asked for
    assert rate == 24000 and len(samples) == SPOKEN


@pytest.mark.parametrize(("body", "param", "says"), REFUSED_CHAT, ids=[p for _, p, _ in REFUSED_CHAT])
def test_chat_refusals(demo: str, body: dict[str, object], param: str, says: str) -> None:
    chat = {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], **body}
    r = HTTP.post(f"{demo}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"instructions": "whisper"}, "instructions", "instructions: not honoured by stage 'thinker'"),
        ({"language": "English"}, "language", "language: not honoured by stage 'thinker'"),
        ({"non_streaming_mode": True}, "non_streaming_mode", "non_streaming_mode: not honoured by stage"),
        ({"response_format": "mp3"}, "response_format", "use wav or pcm"),
        ({"speed": 5}, "speed", "less than or equal to 4"),
        ({"input": ""}, "input", "at least 1 character"),
        ({"voice": "nobody"}, "voice", "voice 'nobody' is not one of this model's voices: alloy, echo"),
    ],
    ids=["instructions", "language", "prompt-mode", "mp3", "too-fast", "nothing-to-say", "unknown-voice"],
)
def test_speech_refusals(demo: str, body: dict[str, object], param: str, says: str) -> None:
    request = {"model": "tiny-omni", "input": "x", "voice": "alloy", **body}
    r = HTTP.post(f"{demo}/v1/audio/speech", json=request, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_an_unknown_voice_is_refused_naming_the_voices(demo: str) -> None:
    """Before anything runs: the gateway knows the voices from the vocoder's heartbeats."""
    chat = {
        "model": "tiny-omni",
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "nobody", "format": "wav"},
    }
    r = HTTP.post(f"{demo}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "audio.voice", err
    assert "voice 'nobody' is not one of this model's voices: alloy, echo" in err["message"], err


def test_an_audio_pipeline_refuses_images(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="cannot output image; it outputs audio, text"):
        client.images.generate(model="tiny-omni", prompt="a cat")


def test_media_to_a_text_only_model_is_refused_before_anything_runs(demo: str) -> None:
    """The demo thinker declares (in its heartbeat) that it reads text only: an image part is a
    400 naming the part, from the gateway, and no stage sees the request."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused", max_retries=0)
    seen = replica_metric(demo, "thinker", "omni_stage_requests_total")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-omni", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
        )
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[1]", body
    assert "cannot read image_url parts; it reads text" in body["message"]
    assert replica_metric(demo, "thinker", "omni_stage_requests_total") == seen


def test_a_prompt_over_the_models_context_is_a_400(demo: str) -> None:
    """2 MB of text (twice a NATS message) reaches the thinker, which counts its tokens against
    the model's context and refuses it as the client's error, saying why."""
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="this model's context is 4096 tokens: the prompt is"):
        client.chat.completions.create(
            model="tiny-omni", messages=[{"role": "user", "content": "ab " * 700_000}]
        )


def test_the_clients_request_id_names_the_request_in_every_stage(demo: str, demo_logs: Path) -> None:
    """A client's X-Request-Id comes back as sent, and is the request's id inside the pipeline
    (with a suffix that keeps two requests with one id apart): every stage's log line for the
    request and each replica's latency exemplar carry it. An id the pipeline cannot carry is
    replaced, and the client gets the replacement."""
    body = {
        "model": "tiny-omni",
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
    }
    body["audio"] = {"voice": "alloy", "format": "wav"}
    r = HTTP.post(
        f"{demo}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7f3a"}, timeout=60
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7f3a"
    assert re.fullmatch(r"chatcmpl-trace-7f3a-[0-9a-f]{12}", r.json()["id"])
    log = demo_logs / "serve.log"
    for stage in ("thinker", "talker", "vocoder"):
        wait_for(
            lambda s=stage: re.search(rf"stage {s}/0: request trace-7f3a-[0-9a-f]{{12}} ok", log.read_text()),
            10,
            f"the {stage}'s log line for the request",
        )
        rep = replicas(demo, stage)[0]
        metrics = HTTP.get(
            f"http://127.0.0.1:{rep['metrics_port']}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
            timeout=5,
        ).text
        assert re.search(
            r'omni_stage_request_seconds_bucket\{.*\} [\d.]+ # \{request_id="trace-7f3a-', metrics
        )

    r = HTTP.post(
        f"{demo}/v1/chat/completions", json=body, headers={"X-Request-Id": "no spaces/here"}, timeout=60
    )
    made = r.headers["x-request-id"]
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", made)
    wait_for(lambda: f"stage thinker/0: request {made} ok" in log.read_text(), 10, "the made id in the log")


def test_speech_streams_as_the_vocoder_produces(tmp_path: Path) -> None:
    """The slow pipeline's talker takes 40 ms a code for 100 codes, so synthesis lasts about 4 s;
    the first bytes reach the client while the vocoder still holds the request."""
    with served(SLOW, ROOT, tmp_path / "serve.log") as (_, base):
        vocoder = metrics_urls([base])["vocoder-0"]
        speech = openai.OpenAI(base_url=f"{base}/v1", api_key="unused").audio.speech
        with speech.with_streaming_response.create(
            model="slow", input="speak", voice="alloy", response_format="pcm"
        ) as response:
            chunks = response.iter_bytes()
            first = next(chunks)
            held = metric_values(vocoder, ("omni_stage_tracked_requests",))["omni_stage_tracked_requests"]
            audio = first + b"".join(chunks)
        assert first and held == 1, "the first bytes came only after synthesis ended"
        assert len(audio) == 2 * 100 * 480 and response.headers["x-sample-rate"] == "24000"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny-omni", "messages": []}, 400, "messages"),
        (
            {"model": "tiny-omni", "messages": [{"role": "user", "content": "x"}], "modalities": ["smell"]},
            400,
            "modalities.0",
        ),
        ({"model": "tiny-omni", "messages": "hello"}, 400, "messages"),
        (
            {"model": "tiny-omni", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
            400,
            "max_tokens",
        ),
        (
            {
                "model": "tiny-omni",
                "messages": [{"role": "user", "content": "x"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "nobody", "format": "wav"},
            },
            400,
            "audio.voice",
        ),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
    ids=[
        "no-messages",
        "unknown-modality",
        "wrong-type",
        "wrong-type-max-tokens",
        "unknown-voice",
        "unknown-model",
    ],
)
def test_errors_are_openai_shaped(demo: str, body: dict[str, object], status: int, param: str | None) -> None:
    r = HTTP.post(f"{demo}/v1/chat/completions", json=body, headers={"X-Request-Id": "my-req-1"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    assert r.headers["x-request-id"] == "my-req-1"


def test_malformed_json_is_400(demo: str) -> None:
    r = HTTP.post(
        f"{demo}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_request_id_is_made_when_absent(demo: str) -> None:
    r = HTTP.get(f"{demo}/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_a_request_past_its_deadline_is_a_504(tmp_path: Path) -> None:
    """The slow pipeline with a 2 s deadline: its talker takes about 4 s to speak a reply, its
    thinker 0.2 s to write one. Text alone is served; speech runs past the deadline and is a
    504 (the talker's timer fires; its error is answered as the gateway's own timer's would
    be), non-streamed or as the stream's error event; nothing stays held."""
    pipeline = yaml.safe_load(SLOW.read_text())
    pipeline["spec"]["gateway"]["requestTimeoutS"] = 2
    (tmp_path / "deadline.yaml").write_text(yaml.safe_dump(pipeline))
    with served(tmp_path / "deadline.yaml", ROOT, tmp_path / "serve.log") as (_, base):
        client = openai_client(base)
        messages = [{"role": "user", "content": "hi"}]
        text = client.chat.completions.create(model="slow", messages=messages)  # type: ignore[arg-type]
        assert text.choices[0].message.content
        idle = gauges([base])  # after a first request: NATS's reply subscription is for good
        speech: dict[str, Any] = {"modalities": ["text", "audio"]}
        speech["audio"] = {"voice": "alloy", "format": "wav"}
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="slow", messages=messages, **speech)  # type: ignore[arg-type]
        assert err.value.status_code == 504, err.value.body
        assert isinstance(err.value.body, dict) and err.value.body["code"] == "timeout"
        assert "deadline" in err.value.body["message"]
        with pytest.raises(openai.APIError) as streamed:
            for _ in client.chat.completions.create(model="slow", messages=messages, stream=True, **speech):  # type: ignore[arg-type]
                pass
        assert isinstance(streamed.value.body, dict) and streamed.value.body["code"] == "timeout"
        settle([base], idle)


def test_sigkill_of_a_stage_mid_request(tmp_path: Path) -> None:
    """The stream goes on: the supervisor restarts the talker, the request waits for it and runs
    again, and the client gets the rest of its text and audio, nothing twice, nothing missing."""
    speech: dict[str, Any] = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
    messages = [{"role": "user", "content": "speak"}]
    with served(SLOW, ROOT, tmp_path / "serve.log") as (serve, base):
        client = openai_client(base)
        talker = next(r for r in get_json(f"{base}/replicas")["replicas"] if r["stage"] == "talker")
        text, pcm = "", b""
        for chunk in client.chat.completions.create(model="slow", messages=messages, stream=True, **speech):  # type: ignore[arg-type]
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if (audio := audio_delta(chunk)) is not None:
                pcm += base64.b64decode(str(audio.get("data") or ""))
                if talker["pid"]:
                    os.kill(talker["pid"], signal.SIGKILL)  # the talker is mid-request now
                    talker["pid"] = 0
        assert talker["pid"] == 0, "the request ended before the talker could be killed"
        again = client.chat.completions.create(model="slow", messages=messages, **speech)  # type: ignore[arg-type]
        assert text == again.choices[0].message.content
        assert again.choices[0].message.audio is not None
        assert pcm == base64.b64decode(again.choices[0].message.audio.data)
        assert "talker-0 died" in serve.output()
        assert "running it again on a fresh route" in serve.output()


def test_a_stage_that_cannot_start_fails_serve_cleanly(demo_dir: Path, tmp_path: Path) -> None:
    example = (ROOT / "examples" / "tiny-omni.yaml").read_text()
    pipeline = tmp_path / "broken.yaml"
    pipeline.write_text(example.replace("./models/tiny-talker", "./models/missing"))
    serve = OmniProcess(["serve", str(pipeline), "--port", "0"], demo_dir, tmp_path / "serve.log")
    wait_for(lambda: serve.proc.poll() is not None, 120, "omni serve to give up")
    assert serve.proc.returncode == 1
    expected = "talker-0 failed to start: EngineError: stage 'talker': model directory './models/missing'"
    assert expected in serve.output()
    wait_group_gone(serve.proc.pid)


def test_bad_pipeline_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "tiny-omni.yaml").read_text().replace("from: thinker", "from: thinkr")
    pipeline = tmp_path / "bad.yaml"
    pipeline.write_text(text)
    serve = OmniProcess(["serve", str(pipeline)], tmp_path, tmp_path / "serve.log")
    assert serve.proc.wait(60) == 2
    assert "stage 'talker': inputs[0].from: unknown stage 'thinkr'" in serve.output()
    assert "nats" not in serve.output().lower()


def test_every_response_conforms_to_openais_schema(demo: str) -> None:
    """Chat (whole, and every streamed chunk with the usage chunk), the models list and one
    model, speech's SSE events, and error bodies, validated against OpenAI's own OpenAPI
    description."""
    chat = {
        "model": "tiny-omni",
        "messages": [{"role": "user", "content": "Hello!"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "max_tokens": 8,
    }
    checked: list[tuple[Any, str]] = []
    post = functools.partial(httpx.post, timeout=120)

    whole = post(f"{demo}/v1/chat/completions", json=chat)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["refusal"] is None
    checked.append((whole.json(), "CreateChatCompletionResponse"))
    stream = post(
        f"{demo}/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse_data(stream.text)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    checked += [(c, "CreateChatCompletionStreamResponse") for c in chunks]
    two = {**chat, "n": 2}
    checked.append((post(f"{demo}/v1/chat/completions", json=two).json(), "CreateChatCompletionResponse"))
    chunks = sse_data(post(f"{demo}/v1/chat/completions", json={**two, "stream": True}).text)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    checked += [(c, "CreateChatCompletionStreamResponse") for c in chunks]
    with_logprobs = {**chat, "logprobs": True, "top_logprobs": 2}
    checked.append(
        (post(f"{demo}/v1/chat/completions", json=with_logprobs).json(), "CreateChatCompletionResponse")
    )
    chunks = sse_data(post(f"{demo}/v1/chat/completions", json={**with_logprobs, "stream": True}).text)
    assert (
        sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"][0]["logprobs"]) == 8
    )
    checked += [(c, "CreateChatCompletionStreamResponse") for c in chunks]
    tool_call = {
        "model": "tiny-omni",
        "messages": chat["messages"],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
    }
    called = post(f"{demo}/v1/chat/completions", json=tool_call).json()
    assert called["choices"][0]["message"]["tool_calls"], called
    checked.append((called, "CreateChatCompletionResponse"))
    chunks = sse_data(post(f"{demo}/v1/chat/completions", json={**tool_call, "stream": True}).text)
    checked += [(c, "CreateChatCompletionStreamResponse") for c in chunks]

    checked.append((HTTP.get(f"{demo}/v1/models").json(), "ListModelsResponse"))
    one = HTTP.get(f"{demo}/v1/models/tiny-omni")
    assert one.status_code == 200 and one.json()["id"] == "tiny-omni"
    checked.append((one.json(), "Model"))

    speech = post(
        f"{demo}/v1/audio/speech",
        json={"model": "tiny-omni", "input": "Hello there", "voice": "alloy", "stream_format": "sse"},
    )
    events = sse_data(speech.text)
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    # The text's tokens as the thinker read them; the codec codes the talker made for the vocoder.
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["output_tokens"] == 4 * 32
    checked += [(e, "CreateSpeechResponseStreamEvent") for e in events]

    missing = HTTP.get(f"{demo}/v1/models/nope")
    bad = post(f"{demo}/v1/chat/completions", json={**chat, "temperature": 3})
    assert (missing.status_code, bad.status_code) == (404, 400)
    checked += [(missing.json(), "ErrorResponse"), (bad.json(), "ErrorResponse")]

    problems = [v for body, schema in checked if (v := violations(body, schema)) is not None]
    assert problems == [], problems


def test_each_stage_process_sees_only_the_gpus_it_was_placed_on(tmp_path: Path) -> None:
    """No GPU here: the supervisor is shown four by their ids (CUDA_VISIBLE_DEVICES, a fake
    count), the synthetic stages ask for GPUs they never touch, and each stage process says,
    from its own environment, where it was placed. Then a placement the machine cannot hold."""
    doc = yaml.safe_load((ROOT / "tests" / "data" / "synthetic.yaml").read_text())
    thinker, talker, vocoder = doc["spec"]["stages"]
    thinker["resources"] = {"gpus": 1}  # packed: the first device nobody placed by hand
    for stage, share in ((talker, 0.5), (vocoder, 0.4)):  # vLLM-Omni's layout: both on device 0
        stage.update(resources={"gpus": 1}, devices="0", shareDevice=True, gpuMemoryFraction=share)
    pipeline = tmp_path / "placed.yaml"
    pipeline.write_text(yaml.safe_dump(doc))
    serve = OmniProcess(
        ["serve", str(pipeline), "--port", "0"],
        ROOT,
        tmp_path / "serve.log",
        {"CUDA_VISIBLE_DEVICES": "3,5,7,9"},
    )
    try:
        serve.wait_output("ready at", 180)
        base = re.search(r"ready at (http://127.0.0.1:\d+)/v1", serve.output()).group(1)  # type: ignore[union-attr]
        # What each stage process itself found in its environment (it says so as it starts: its
        # title has taken the place /proc/PID/environ reads)
        seen = dict(
            re.findall(
                r"stage (\w+)/0: loading engine synthetic \(CUDA_VISIBLE_DEVICES=([\d,]*)\)", serve.output()
            )
        )
        assert seen == {"thinker": "5", "talker": "3", "vocoder": "3"}
        assert len(get_json(f"{base}/replicas")["replicas"]) == 3
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)

    serve = OmniProcess(
        ["serve", str(pipeline), "--port", "0"], ROOT, tmp_path / "serve2.log", {"CUDA_VISIBLE_DEVICES": "3"}
    )
    assert serve.proc.wait(60) == 1
    assert (
        "omni serve: stage 'thinker': resources.gpus: replica 0 needs 1, but other stages took all 1"
        in serve.output()
    )


def test_a_batch_of_conversations_in_one_call_as_vllms(demo: str) -> None:
    """vLLM's /v1/chat/completions/batch: one choice per conversation, in order, each what the
    conversation alone would get (greedy), and the usage of them all; what vLLM's refuses
    (`stream`, more than 32 conversations) a 400 naming it; a conversation the endpoint
    refuses makes the answer its error."""
    conversations = [
        [{"role": "user", "content": f"Tell me about {x}"}] for x in ("the sea", "a fox", "rain")
    ]
    asked = {"model": "tiny-omni", "max_tokens": 6, "temperature": 0}
    r = HTTP.post(f"{demo}/v1/chat/completions/batch", json={**asked, "messages": conversations}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for conversation, choice in zip(conversations, body["choices"], strict=True):
        alone = HTTP.post(
            f"{demo}/v1/chat/completions", json={**asked, "messages": conversation}, timeout=120
        )
        assert choice["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 3 * 6
    for extra, param in (({"stream": True}, "stream"), ({"messages": [conversations[0]] * 33}, "messages")):
        refused = HTTP.post(
            f"{demo}/v1/chat/completions/batch", json={**asked, "messages": conversations, **extra}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    bad = [*conversations, [{"role": "nobody", "content": "x"}]]
    refused = HTTP.post(f"{demo}/v1/chat/completions/batch", json={**asked, "messages": bad}, timeout=120)
    assert refused.status_code == 400, refused.text
