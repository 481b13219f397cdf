"""`omni serve` end to end, as a user runs it: the official openai client against the real
process tree (embedded nats-server, one process per stage, the gateway)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import soundfile as sf

from tests.deployment import metric_values, metrics_urls
from tests.helpers import (
    ROOT,
    OmniProcess,
    decode_wav,
    get_json,
    group_alive,
    served,
    served_example,
    wait_for,
)

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
def demo(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_example("tiny-omni.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as base:
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
    audio = b""
    for chunk in stream:
        if not chunk.choices:
            kinds.append("usage")
            continue
        delta = chunk.choices[0].delta
        if (a := audio_delta(chunk)) is not None:
            kinds.append("audio")
            audio += base64.b64decode(a["data"])
        elif delta.content:
            kinds.append("text")
        if chunk.choices[0].finish_reason:
            kinds.append("finish")
    assert kinds.index("text") < kinds.index("finish")
    assert kinds[: kinds.index("finish")].count("audio") >= 2
    assert kinds[-1] == "usage"
    samples, sr = sf.read(io.BytesIO(audio))  # the chunks form one playable WAV
    assert sr == 24000 and len(samples) == 32 * 4 * 480


def test_text_only_and_models(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    r = client.chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert r.choices[0].message.audio is None and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5
    [model] = client.models.list().data
    assert model.id == "tiny-omni" and (model.model_extra or {})["modalities"] == ["audio", "text"]


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
    r = httpx.post(f"{demo}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"] and len(events) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    samples, rate = sf.read(io.BytesIO(audio))  # the deltas make the WAV file asked for
    assert rate == 24000 and len(samples) == SPOKEN


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": "mp3"}, "response_format", "use wav or pcm"),
        ({"speed": 5}, "speed", "less than or equal to 4"),
        ({"input": ""}, "input", "at least 1 character"),
        ({"voice": None}, "voice", ""),
    ],
    ids=["mp3", "too-fast", "nothing-to-say", "no-voice"],
)
def test_speech_refusals(demo: str, body: dict[str, object], param: str, says: str) -> None:
    request = {"model": "tiny-omni", "input": "x", "voice": "alloy", **body}
    r = httpx.post(f"{demo}/v1/audio/speech", json=request, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_an_audio_pipeline_refuses_images(demo: str) -> None:
    client = openai.OpenAI(base_url=f"{demo}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="cannot output image; it outputs audio, text"):
        client.images.generate(model="tiny-omni", prompt="a cat")


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
            },
            400,
            None,
        ),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
    ids=[
        "no-messages",
        "unknown-modality",
        "wrong-type",
        "wrong-type-max-tokens",
        "audio-without-params",
        "unknown-model",
    ],
)
def test_errors_are_openai_shaped(demo: str, body: dict[str, object], status: int, param: str | None) -> None:
    r = httpx.post(f"{demo}/v1/chat/completions", json=body, headers={"X-Request-Id": "my-req-1"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    assert r.headers["x-request-id"] == "my-req-1"


def test_malformed_json_is_400(demo: str) -> None:
    r = httpx.post(
        f"{demo}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_request_id_is_made_when_absent(demo: str) -> None:
    r = httpx.get(f"{demo}/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_sigkill_of_a_stage_mid_request(tmp_path: Path) -> None:
    with served(SLOW, ROOT, tmp_path / "serve.log") as (serve, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        talker = next(r for r in get_json(f"{base}/replicas")["replicas"] if r["stage"] == "talker")
        stream = client.chat.completions.create(
            model="slow",
            messages=[{"role": "user", "content": "speak"}],
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
        )
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                if audio_delta(chunk) is not None and talker["pid"]:
                    os.kill(talker["pid"], signal.SIGKILL)  # the talker is mid-request now
                    talker["pid"] = 0
        assert talker["pid"] == 0, "the request ended before the talker could be killed"
        assert "stage 'talker'" in str(info.value)

        def restarted() -> bool:
            reps = get_json(f"{base}/replicas")["replicas"]
            return any(r["stage"] == "talker" and r["instance"] != talker["instance"] for r in reps)

        wait_for(restarted, 60, "the supervisor to restart the talker")
        r = client.chat.completions.create(
            model="slow",
            messages=[{"role": "user", "content": "again"}],
            max_tokens=10,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
        assert r.choices[0].message.content.startswith("tok0") and r.choices[0].message.audio is not None
        assert "talker-0 died" in serve.output()


def test_a_stage_that_cannot_start_fails_serve_cleanly(demo_dir: Path, tmp_path: Path) -> None:
    example = (ROOT / "examples" / "tiny-omni.yaml").read_text()
    pipeline = tmp_path / "broken.yaml"
    pipeline.write_text(example.replace("./models/tiny-talker", "./models/missing"))
    serve = OmniProcess(["serve", str(pipeline), "--port", "0"], demo_dir, tmp_path / "serve.log")
    wait_for(lambda: serve.proc.poll() is not None, 120, "omni serve to give up")
    assert serve.proc.returncode == 1
    expected = "talker-0 failed to start: EngineError: stage 'talker': model directory './models/missing'"
    assert expected in serve.output()
    wait_for(lambda: not group_alive(serve.proc.pid), 30, "every process of the tree to exit")


def test_bad_pipeline_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    text = (ROOT / "examples" / "tiny-omni.yaml").read_text().replace("from: thinker", "from: thinkr")
    pipeline = tmp_path / "bad.yaml"
    pipeline.write_text(text)
    serve = OmniProcess(["serve", str(pipeline)], tmp_path, tmp_path / "serve.log")
    assert serve.proc.wait(60) == 2
    assert "stage 'talker': inputs[0].from: unknown stage 'thinkr'" in serve.output()
    assert "nats" not in serve.output().lower()
