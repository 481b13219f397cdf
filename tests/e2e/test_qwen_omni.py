"""Qwen2.5-Omni served end to end: `omni serve examples/qwen2.5-omni.yaml` (thinker -> talker
-> code2wav from one tiny checkpoint), the official openai client, and the reference computed
here: transformers' `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`,
same checkpoint, same prompt, greedy, the DiT's noise from the same seed."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
import soxr
import yaml

from omni_gateway.audio import to_pcm16
from tests.deployment import gauges, settle
from tests.e2e.test_serve import audio_delta
from tests.helpers import (
    ROOT,
    SERVES_QWEN_TIMEOUT_S,
    VLLM_TIMEOUT_S,
    decode_wav,
    replica_metric,
    served,
    served_example,
    vllm_bench_serve,
    vllm_omni_duplex_client,
    wait_for,
)
from tests.qwen_reference import (
    media_clips,
    media_message,
    reference_generate,
    reference_with_media,
    reference_with_video,
    video_clip,
    video_message,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leaves_base_as_it_found_it")]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
THINKER_TOKENS, TALKER_CODES, SEED = 10, 48, 11  # TALKER_CODES: the example's talker max_tokens


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen2.5-omni.yaml served, after a first request (the NATS client makes its
    request-reply subscription on the first: what a gateway holds idle from then on, so a
    test that reads the idle gauges does not depend on running after another)."""
    with served_example("qwen2.5-omni.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as url:
        ask(url, max_tokens=1)
        yield url


@pytest.fixture(scope="module")
def reference(demo_dir: Path) -> dict[str, Any]:
    path = demo_dir / "models" / "tiny-qwen2.5-omni"
    ref = reference_generate(path, MESSAGES, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    return {"text": ref["text"], "audio": ref["audio"].numpy()}


def pcm16(samples: np.ndarray) -> np.ndarray:
    """What the gateway's 16-bit PCM carries of a float waveform, read back as soundfile reads it."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16) / 32768.0


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(base: str, **extra: Any) -> Any:
    return client(base).chat.completions.create(
        model="qwen2.5-omni",
        modalities=["text", "audio"],
        seed=SEED,
        **{"messages": MESSAGES, "max_tokens": THINKER_TOKENS, **extra},
    )


def stream(
    base: str, messages: list[dict[str, Any]] = MESSAGES, voice: str = "Ethan", **extra: Any
) -> tuple[list[str], str, bytes]:
    """A streamed answer in audio (pcm16) and text: the order of its events, its text, its PCM."""
    events, text, pcm = [], "", b""
    for chunk in ask(
        base, messages=messages, stream=True, audio={"voice": voice, "format": "pcm16"}, **extra
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            events.append("text")
            text += chunk.choices[0].delta.content
        if (a := audio_delta(chunk)) is not None and a.get("data"):
            events.append("audio")
            pcm += base64.b64decode(str(a["data"]))
    return events, text, pcm


def assert_speech_is(pcm: bytes, reference_audio: np.ndarray) -> None:
    """Streamed PCM16 against the reference's float waveform: the same length, within one step."""
    samples = np.frombuffer(pcm, dtype="<i2") / 32768.0
    expected = pcm16(reference_audio)
    assert samples.shape == expected.shape
    assert np.abs(samples - expected).max() <= 1 / 32768


def assert_audio_starts_before_the_text_ends(events: list[str]) -> None:
    assert events.count("audio") > 1
    last_text = len(events) - 1 - events[::-1].index("text")
    assert events.index("audio") < last_text, events


@pytest.mark.timeout(SERVES_QWEN_TIMEOUT_S)  # the module's first: its pipeline starts for it
def test_text_and_speech_equal_the_reference(base: str, reference: dict[str, Any]) -> None:
    """Text exactly; the waveform, decoded in chunks as it streams, to within one step of
    16-bit PCM (in float32 it is within 1e-5 of the reference's, tests/unit/test_qwen_omni.py)."""
    r = ask(base, audio={"voice": "Ethan", "format": "wav"})
    assert r.choices[0].message.content == reference["text"]
    samples, rate = decode_wav(r.choices[0].message.audio.data)
    assert rate == 24000
    expected = pcm16(reference["audio"])
    assert samples.shape == expected.shape
    assert np.abs(samples - expected).max() <= 1 / 32768


def test_streamed_text_and_speech_equal_the_reference(base: str, reference: dict[str, Any]) -> None:
    _, text, pcm = stream(base)
    assert text == reference["text"]
    assert_speech_is(pcm, reference["audio"])


def test_an_unknown_voice_is_a_400_that_lists_the_voices(base: str) -> None:
    with pytest.raises(
        openai.BadRequestError, match="voice 'alloy' is not one of this model's voices: Chelsie, Ethan"
    ):
        ask(base, audio={"voice": "alloy", "format": "wav"})


def test_audio_starts_before_the_text_ends(base: str) -> None:
    """The first audio chunk needs 24 codes (12, and 12 of right context), so 25 thinker
    tokens, and one chunk's decode; the thinker writes 1000. Measured on 2 cores: the first
    audio came about 220 tokens in. Order of events in the stream, not timing."""
    events, _, _ = stream(base, voice="Chelsie", max_tokens=1000)
    assert_audio_starts_before_the_text_ends(events)


def test_a_one_token_answer_is_text_and_no_speech(base: str) -> None:
    """The talker starts on the second token's reply state: a one-token answer has nothing to
    speak. transformers' own generate fails on it; the server answers text and empty audio."""
    r = ask(base, audio={"voice": "Ethan", "format": "wav"}, max_tokens=1)
    assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens == 1
    samples, _ = decode_wav(r.choices[0].message.audio.data)
    assert len(samples) == 0


def spoken_turn(seconds: float) -> bytes:
    """PCM16 at 24 kHz, as a Realtime client sends it: a tone in noise, from a seed."""
    rng = np.random.default_rng(5)
    t = np.arange(int(24000 * seconds)) / 24000
    clip = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(t.size)
    return (clip * 32767).astype("<i2").tobytes()


def realtime_until(conn: Any, last: str) -> list[Any]:
    """The SDK's server events up to and including the first of type `last`."""
    events = []
    while (event := conn.recv()).type != last:
        events.append(event)
    return [*events, event]


def user_says(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_a_spoken_turn_over_the_realtime_api(base: str) -> None:
    """The Realtime acceptance, through the openai SDK: a turn of audio appended in 100 ms pieces
    and committed is heard as the chat endpoint hears the same audio (the same text; speech in
    deltas), though the thinker encoded its two whole windows (2 s each) as they arrived and only
    the last part at the commit; a bad event is an error after which the session goes on, a second turn is
    answered (as the chat endpoint answers the conversation, though its prefill reused the first
    turn's sequence), and a response cancelled after its first audio ends `cancelled`."""
    pcm = spoken_turn(5.0)
    windows = "omni_engine_audio_windows_total"
    ahead = replica_metric(base, "thinker", windows, encoded="ahead")
    late = replica_metric(base, "thinker", windows, encoded="late")
    with client(base).realtime.connect(model="qwen2.5-omni") as conn:
        assert conn.recv().type == "session.created"
        voice = {
            "type": "realtime",
            "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
        }
        conn.send({"type": "session.update", "session": voice})
        assert conn.recv().type == "session.updated"
        for at in range(0, len(pcm), 4800):
            piece = base64.b64encode(pcm[at : at + 4800]).decode()
            conn.send({"type": "input_audio_buffer.append", "audio": piece})
        conn.send({"type": "input_audio_buffer.commit"})
        conn.send({"type": "response.create", "response": {"max_output_tokens": THINKER_TOKENS}})
        events = realtime_until(conn, "response.done")
        transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
        assert events[-1].response.status == "incomplete"  # cut at THINKER_TOKENS
        assert sum(e.type == "response.output_audio.delta" for e in events) > 1
        wav = io.BytesIO()
        soundfile.write(wav, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
        data = base64.b64encode(wav.getvalue()).decode()
        heard = {
            "role": "user",
            "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}],
        }
        assert replica_metric(base, "thinker", windows, encoded="ahead") - ahead == 2
        assert replica_metric(base, "thinker", windows, encoded="late") - late == 1
        assert transcript == ask(base, messages=[heard]).choices[0].message.content

        conn.send({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "bad"})
        error = conn.recv()
        assert error.type == "error" and error.error.event_id == "bad" and error.error.param == "audio"

        conn.send({"type": "conversation.item.create", "item": user_says("Say more.")})
        conn.send({"type": "response.create", "response": {"max_output_tokens": 4}})
        second = realtime_until(conn, "response.done")
        assert second[-1].response.status == "incomplete"
        # Heard after the first turn's sequence, which the thinker kept: as a whole prefill hears it.
        assert second[-1].response.usage.input_token_details.cached_tokens > 0
        again = "".join(e.delta for e in second if e.type == "response.output_audio_transcript.delta")
        history = [
            heard,
            {"role": "assistant", "content": transcript},
            {"role": "user", "content": "Say more."},
        ]
        assert again == ask(base, messages=history, max_tokens=4).choices[0].message.content

        conn.send({"type": "conversation.item.create", "item": user_says("Tell me about the sea.")})
        conn.send({"type": "response.create", "response": {"max_output_tokens": 1000}})
        realtime_until(conn, "response.output_audio.delta")
        conn.send({"type": "response.cancel"})
        assert realtime_until(conn, "response.done")[-1].response.status == "cancelled"

    # A turn spoken but never answered: what its replica encoded ahead goes with the session.
    sessions = lambda: replica_metric(base, "thinker", "omni_engine_audio_ahead_sessions")  # noqa: E731
    with client(base).realtime.connect(model="qwen2.5-omni") as conn:
        conn.send({"type": "session.update", "session": voice})
        conn.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[:48000]).decode()})
        wait_for(lambda: sessions() == 1, 30, "the thinker to hear the turn")
    wait_for(lambda: sessions() == 0, 30, "the thinker to give the closed session's audio up")


def test_vllm_omnis_duplex_client_talks_resumes_and_cuts_in(base: str, tmp_path: Path) -> None:
    """vLLM-Omni's DuplexClient, as its users drive `/v1/realtime?duplex=1`
    (scripts/vllm_omni_duplex_client.py), on a model without native duplex (turn-based, as
    vLLM-Omni's fallback says). A turn spoken at 16 kHz (the client's default rate) is heard as
    the chat endpoint hears the same audio at 24 kHz (the gateway resamples it as it comes), though
    the connection was cut at the answer's first audio: the client resumed, and got every event
    once, in order, and all the audio sent. A second answer, cut in on (`barge_in`) with one chunk
    acknowledged as played, ends `cancelled`, and the conversation keeps what was played."""
    rng = np.random.default_rng(5)
    t = np.arange(16000 * 3) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(t.size)) * 32767
    pcm = tmp_path / "turn.pcm"
    pcm.write_bytes(clip.astype("<i2").tobytes())
    url = base.replace("http://", "ws://") + "/v1/realtime"
    seen = vllm_omni_duplex_client(url, "qwen2.5-omni", pcm, 16000, "Ethan", THINKER_TOKENS, 1000)

    assert seen["session"]["capabilities"]["implementation_level"] == "turn_based_duplex"
    events = seen["events"]
    types = [e["type"] for e in events]
    assert types.count("connection.resumed") == 1 and types.count("session.resumed") == 1
    numbers = [e["server_event_seq"] for e in events if e["server_event_seq"] is not None]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    resumed = seen["resumed"]
    assert resumed["decision"] == "speak" and resumed["status"] == "incomplete"  # cut at THINKER_TOKENS
    acks = [e["event"] for e in events if e["type"] == "playback.acknowledged"]
    last_ack = [a for a in acks if a["response_id"] == resumed["response_id"]][-1]
    assert last_ack["played_ms"] == last_ack["sent_ms"] == resumed["audio_ms"] > 0
    # What the gateway hears: the same samples as resampling the whole turn at once.
    at24k = soxr.resample(clip.astype(np.float32) / 32768.0, 16000, 24000)
    heard = io.BytesIO()
    soundfile.write(heard, np.frombuffer(to_pcm16(at24k), "<i2"), 24000, format="WAV", subtype="PCM_16")
    data = base64.b64encode(heard.getvalue()).decode()
    turn = {
        "role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}],
    }
    assert resumed["transcript"] == ask(base, messages=[turn]).choices[0].message.content

    barged = seen["barged"]
    assert barged["status"] == "cancelled"
    truncated = [e for e in events if e["type"] == "conversation.item.truncated"]
    assert [e["audio_end_ms"] for e in truncated] == [seen["acked_before_barge_in_ms"]]
    assert 0 < seen["acked_before_barge_in_ms"] < barged["audio_ms"]
    assert types[-1] == "session.closed"


@pytest.fixture(scope="module")
def media_reference(demo_dir: Path) -> dict[str, Any]:
    path = demo_dir / "models" / "tiny-qwen2.5-omni"
    ref = reference_with_media(path, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    return {"text": ref["text"], "audio": ref["audio"].numpy()}


def assert_the_acceptance_request_is_served(
    base: str, reference: dict[str, Any], ordered: bool = True
) -> None:
    """The acceptance request: text + input_audio + image_url, modalities text and audio,
    streamed. Its text is the reference's on the same clip and image, its audio the
    reference's waveform to within one 16-bit step; and on a long answer the talker and
    code2wav work window by window as the text comes (the talker is triggered per window, the
    audio comes in chunks), and, where `ordered`, the audio starts before the text ends. That
    order is a race between the thinker and the two stages after it: the transformers
    thinker writes 1000 tokens far slower than the talker speaks its 48 codes, but vLLM's
    thinker on a machine loaded by other work has been seen to finish first, so the vLLM
    variant checks the windows alone. Afterwards no process holds anything for it (the
    media's shm segments included)."""
    idle = gauges([base])
    message = media_message(*media_clips())
    _, text, pcm = stream(base, [message])
    assert text == reference["text"]
    assert_speech_is(pcm, reference["audio"])
    triggered = replica_metric(base, "talker", "omni_stage_window_triggers_total")
    events, _, _ = stream(base, [message], max_tokens=1000)
    assert replica_metric(base, "talker", "omni_stage_window_triggers_total") - triggered > 10
    assert events.count("audio") > 1
    if ordered:
        assert_audio_starts_before_the_text_ends(events)
    settle([base], idle)


def test_text_audio_and_an_image_in_stream_text_and_speech_out(
    base: str, media_reference: dict[str, Any]
) -> None:
    assert_the_acceptance_request_is_served(base, media_reference)


def test_a_video_in_text_and_speech_out_equal_the_reference(base: str, demo_dir: Path) -> None:
    """A `video_url` part (a data: URL, as vLLM's clients send it), streamed: the gateway takes
    2 frames a second, the thinker runs the model's video processor; text and speech are the
    reference's on the same frames."""
    path = demo_dir / "models" / "tiny-qwen2.5-omni"
    ref = reference_with_video(path, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    _, text, pcm = stream(base, [video_message(video_clip()[0])])
    assert text == ref["text"]
    assert_speech_is(pcm, ref["audio"].numpy())


@pytest.fixture(scope="module")
def vllm_base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen2.5-omni-vllm.yaml served, after a first request (the NATS client makes its
    request-reply subscription on the first: what a gateway holds idle from then on)."""
    with served_example("qwen2.5-omni-vllm.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as url:
        ask(url, audio={"voice": "Ethan", "format": "wav"}, max_tokens=1)
        yield url


@pytest.mark.timeout(VLLM_TIMEOUT_S)  # the first of the module's tests on vLLM starts it
def test_on_vllm_text_audio_and_an_image_in_stream_text_and_speech_out(
    vllm_base: str, media_reference: dict[str, Any]
) -> None:
    """The acceptance request again, the thinker on vLLM (examples/qwen2.5-omni-vllm.yaml).
    And what neither Qwen thinker honours (tools, even in a text-only reply) is a 400 naming
    it, not dropped."""
    assert_the_acceptance_request_is_served(vllm_base, media_reference, ordered=False)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client(vllm_base).chat.completions.create(
            model="qwen2.5-omni", modalities=["text"], messages=MESSAGES, max_tokens=4, tools=[tool]
        )
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "tools", err.value.body


@pytest.mark.timeout(VLLM_TIMEOUT_S)
def test_vllm_omni_cli_runs_against_the_vllm_thinker_pipeline(
    vllm_base: str, demo_dir: Path, tmp_path: Path
) -> None:
    """vLLM-Omni's own `vllm bench serve --omni` (its console entry point, its virtualenv)
    against Qwen2.5-Omni with its thinker on vLLM, as against vLLM-Omni itself: every request
    succeeds, text well before the end, tokens apart, speech measured."""
    tokenizer = demo_dir / "models" / "tiny-qwen2.5-omni"
    got = vllm_bench_serve(
        vllm_base, "qwen2.5-omni", tokenizer, tmp_path, prompts=10, concurrency=2, tokens=8
    )
    assert got["completed"] == 10 and got["failed"] == 0, got["errors"]
    assert 0 < got["mean_ttft_ms"] < 0.7 * got["mean_e2el_ms"] and got["mean_tpot_ms"] > 0, got
    assert got["mean_audio_ttfp_ms"] > 0 and got["mean_audio_rtf"] > 0, got


@pytest.fixture(scope="module")
def epd_base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen2.5-omni-epd.yaml served: the encoders in a stage of their own."""
    with served_example("qwen2.5-omni-epd.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as url:
        ask(url, audio={"voice": "Ethan", "format": "wav"}, max_tokens=1)
        yield url


def test_with_the_encoders_split_out_the_answers_are_the_same(
    epd_base: str, demo_dir: Path, reference: dict[str, Any], media_reference: dict[str, Any]
) -> None:
    """examples/qwen2.5-omni-epd.yaml: the acceptance request (audio and an image) and a video
    go through the encoder stage and get the reference's text and speech, as through the
    unsplit pipeline, the media sent to the encoder alone (two 1.5 s float32 clips are 192 KB);
    a request without media gets its answer without the encoder stage ever seeing it (its
    count of requests does not move). Every request sets `seed`, which the encoder stage does
    not take: what a stage the route may skip honours does not decide what is refused."""
    assert_the_acceptance_request_is_served(epd_base, media_reference)
    encoded = replica_metric(epd_base, "encoder", "omni_stage_requests_total")
    assert encoded == 2  # the acceptance's two requests, not the fixture's text-only one
    # The media cross the connector to the encoder only (the thinker's edge has media: false).
    read = {
        s: replica_metric(epd_base, s, "omni_connector_bytes_total", op="get", peer="request")
        for s in ("encoder", "thinker")
    }
    assert read["encoder"] > 2 * 96_000 and read["thinker"] * 10 < read["encoder"], read
    path = demo_dir / "models" / "tiny-qwen2.5-omni"
    ref = reference_with_video(path, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    _, text, pcm = stream(epd_base, [video_message(video_clip()[0])])
    assert text == ref["text"]
    assert_speech_is(pcm, ref["audio"].numpy())
    _, text, pcm = stream(epd_base)
    assert text == reference["text"]
    assert_speech_is(pcm, reference["audio"])
    assert replica_metric(epd_base, "encoder", "omni_stage_requests_total") == encoded + 1


def test_bad_media_is_a_400_naming_the_part_and_leaves_nothing_behind(base: str) -> None:
    """A sample of the cases tests/unit/test_media.py covers one by one, through the real
    gateway and the openai client: each a 400 whose param is the part."""
    idle = gauges([base])
    wav, png = media_clips()
    good = media_message(wav, png)["content"]
    cases = {
        "not base64": {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
        "truncated": {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(wav[: len(wav) // 2]).decode(), "format": "wav"},
        },
        "format 'aac' is not served": {
            "type": "input_audio",
            "input_audio": {"data": "AAAA", "format": "aac"},
        },
        "does not fetch URLs": {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}},
        "not decodable as a video": {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    }
    for says, part in cases.items():
        message = {"role": "user", "content": [*good, part]}
        with pytest.raises(openai.BadRequestError) as err:
            ask(base, messages=[message], audio={"voice": "Ethan", "format": "wav"})
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "messages[0].content[3]", body
        assert says in body["message"], body
    too_many = {"role": "user", "content": [good[1]] * 9}
    with pytest.raises(openai.BadRequestError, match="more than 8 media parts"):
        ask(base, messages=[too_many], audio={"voice": "Ethan", "format": "wav"})
    settle([base], idle)


def test_speech_is_whole_when_a_stream_ends_on_a_window_boundary(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The example with segments cut by count alone (no flush timer): a long answer fills the
    talker's budget of 48 codes, six segments of 8 and four windows of 12, so its stream ends
    with an empty chunk. code2wav, still holding its last 12 codes for their right context,
    must decode them on that empty last chunk: the audio is 480 samples for every code.
    (With the timer, where the stream ends depends on timing; this case once went silent.)"""
    example = yaml.safe_load((ROOT / "examples" / "qwen2.5-omni.yaml").read_text())
    for stage in example["spec"]["stages"]:
        stage["flushIntervalMs"] = 3_600_000
    pipeline = demo_dir / "qwen2.5-omni-count-flush.yaml"
    pipeline.write_text(yaml.safe_dump(example))
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, base):
        r = ask(base, audio={"voice": "Ethan", "format": "wav"}, max_tokens=1000)
        samples, _ = decode_wav(r.choices[0].message.audio.data)
    assert len(samples) == TALKER_CODES * 480
