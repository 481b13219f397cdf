"""`WS /v1/realtime` end to end: the official openai SDK's `client.realtime.connect()` and a plain
`websockets` client against `omni serve` of the tiny demo (it reads text and speaks), as their
users run them. What a response says is what the chat endpoint says for the same conversation."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
import soxr
import yaml
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidStatus
from websockets.sync.client import connect

from tests.deployment import gauges, metric_values, metrics_urls, settle
from tests.e2e.test_serve import audio_delta
from tests.helpers import ROOT, replicas, served, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leaves_base_as_it_found_it")]

MODEL = "tiny-omni"
ENDS = "response.done"
LONG = 4000
"""Tokens for a response that is still speaking when a test interrupts it (the tiny demo's
greedy answers run to their limit: 4000 take about 20 s here)."""
GRACE = 5.0
"""How long a duplex session whose socket dropped waits for its resume here."""


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny demo, its gateway holding two live sessions at most (a duplex one GRACE s after
    its socket drops) and reading messages of 1 MiB at most, after a first request (the NATS
    client makes its request-reply subscription on the first: held idle from then on, so a
    test that reads the idle gauges does not depend on running after another)."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())
    spec["spec"]["gateway"]["realtime"] = {"maxSessions": 2, "resumeGraceS": GRACE}
    spec["spec"]["gateway"]["maxRequestBytes"] = 1 << 20  # and socket messages
    pipeline = demo_dir / "tiny-omni-realtime.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, url):
        chat(url, [{"role": "user", "content": "Hello"}], 1)
        yield url


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def ws_url(base: str) -> str:
    return f"{base.replace('http://', 'ws://')}/v1/realtime?model={MODEL}"


def user_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def until(conn: Any, last: str = ENDS) -> list[dict[str, Any]]:
    """Server events up to and including the first of type `last`, as plain dicts."""
    seen = []
    while True:
        event = conn.recv()
        seen.append(event if isinstance(event, dict) else event.model_dump(exclude_unset=True))
        if seen[-1]["type"] == last:
            return seen


def said(events: list[dict[str, Any]]) -> tuple[str, bytes]:
    """A response's transcript and its audio (PCM16), from its deltas."""
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    return text, pcm


def chat(base: str, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, bytes]:
    """The same conversation through the chat endpoint, streamed: its text and its PCM16."""
    text, pcm = "", b""
    for chunk in sdk(base).chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=max_tokens,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if (a := audio_delta(chunk)) is not None and a.get("data"):
            pcm += base64.b64decode(str(a["data"]))
    return text, pcm


def kept_sequences(base: str) -> float:
    """Conversations' sequences the replicas keep (prompt_cache_key), all stages together."""
    return sum(
        metric_values(url, ("omni_engine_prompt_caches",)).get("omni_engine_prompt_caches", 0.0)
        for url in metrics_urls([base]).values()
    )


def test_a_turn_and_the_next_say_what_the_chat_endpoint_says(base: str) -> None:
    """Two turns on one session through the openai SDK, in the protocol's order of events; the
    second reads the first answer back as the assistant's turn, and its prefill reuses the
    sequence the thinker kept of the first (`cached_tokens`) yet says what the chat endpoint
    says computing it whole. The session closed, its sequence is given up."""
    before = kept_sequences(base)
    with sdk(base).realtime.connect(model=MODEL) as conn:
        created = until(conn, "session.created")[-1]
        assert created["session"]["model"] == MODEL
        assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        conn.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"output": {"voice": "alloy"}}},
            }
        )
        assert until(conn, "session.updated")[-1]["session"]["audio"]["output"]["voice"] == "alloy"

        conn.send({"type": "conversation.item.create", "item": user_text("Hello there")})
        added = until(conn, "conversation.item.done")
        assert [e["type"] for e in added] == ["conversation.item.added", "conversation.item.done"]
        conn.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        first = until(conn)
        kinds = [e["type"] for e in first if not e["type"].endswith(".delta")]
        assert kinds == [
            "response.created",
            "response.output_item.added",
            "conversation.item.added",
            "response.content_part.added",
            "response.output_audio.done",
            "response.output_audio_transcript.done",
            "response.content_part.done",
            "response.output_item.done",
            "conversation.item.done",
            "response.done",
        ]
        done = first[-1]["response"]
        assert done["status"] == "incomplete"  # 8 tokens: cut at max_output_tokens
        assert done["status_details"]["reason"] == "max_output_tokens"
        assert done["usage"]["output_token_details"]["text_tokens"] == 8
        text, pcm = said(first)
        assert (text, pcm) == chat(base, [{"role": "user", "content": "Hello there"}], 8)
        assert done["output"][0]["content"][0]["transcript"] == text

        conn.send({"type": "conversation.item.create", "item": user_text("And then?")})
        until(conn, "conversation.item.done")
        conn.send({"type": "response.create", "response": {"max_output_tokens": 6}})
        second = until(conn)
        history = [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "And then?"},
        ]
        assert said(second) == chat(base, history, 6)
        assert done["usage"]["input_token_details"]["cached_tokens"] == 0
        cached = second[-1]["response"]["usage"]["input_token_details"]["cached_tokens"]
        assert 0 < cached < second[-1]["response"]["usage"]["input_tokens"]
        assert kept_sequences(base) == before + 1
    wait_for(lambda: kept_sequences(base) == before, 10, "the session's sequence to be given up")


def test_a_chat_conversation_named_by_prompt_cache_key_reuses_its_last_turn(base: str) -> None:
    """The chat API with OpenAI's `prompt_cache_key`: turn 2 reports the prompt tokens turn 1's
    sequence held (`usage.prompt_tokens_details.cached_tokens`) and answers what it answers
    without the key; a key longer than OpenAI's 64 characters is a 400 naming it."""
    client = sdk(base)
    ask = lambda messages, **extra: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=messages, max_tokens=6, modalities=["text"], **extra
    )
    turn1 = [{"role": "user", "content": "Hello there"}]
    first = ask(turn1, prompt_cache_key="chat-conversation")
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content}]
    turn2.append({"role": "user", "content": "Go on."})
    kept, whole = ask(turn2, prompt_cache_key="chat-conversation"), ask(turn2)
    assert kept.choices[0].message.content == whole.choices[0].message.content
    assert kept.usage is not None and kept.usage.prompt_tokens_details is not None
    assert 0 < (kept.usage.prompt_tokens_details.cached_tokens or 0) < kept.usage.prompt_tokens
    assert whole.usage is not None and whole.usage.prompt_tokens_details is None
    with pytest.raises(openai.BadRequestError) as refused:
        ask(turn1, prompt_cache_key="k" * 65)
    assert refused.value.body["param"] == "prompt_cache_key"  # type: ignore[index]


def test_text_only_sessions_stream_output_text(base: str) -> None:
    with sdk(base).realtime.connect(model=MODEL) as conn:
        until(conn, "session.created")
        conn.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
        until(conn, "session.updated")
        conn.send({"type": "conversation.item.create", "item": user_text("Hello there")})
        conn.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        events = until(conn)
        assert not [e for e in events if "audio" in e["type"]]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert text and done["text"] == text


def test_a_bad_event_gets_an_error_and_the_session_goes_on(base: str) -> None:
    """A plain websockets client, as agent frameworks use: each bad event is an `error` naming its
    field and echoing the client's event_id; the next turn is answered."""
    with connect(ws_url(base)) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        bad = [
            ({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "e1"}, "audio"),
            ({"type": "session.update", "session": {"tools": []}, "event_id": "e2"}, "session.tools"),
            ({"type": "no.such.event", "event_id": "e3"}, "type"),
            ({"type": "input_audio_buffer.commit", "event_id": "e4"}, None),
            ({"type": "conversation.item.delete", "item_id": "item_x", "event_id": "e5"}, "item_id"),
            ({"type": "response.cancel", "event_id": "e6"}, "response_id"),
        ]
        for event, param in bad:
            ws.send(json.dumps(event))
            error = json.loads(ws.recv())
            assert error["type"] == "error", error
            assert error["error"]["event_id"] == event["event_id"]
            assert error["error"]["param"] == param, error
        ws.send("not json")
        assert json.loads(ws.recv())["error"]["code"] == "invalid_json"

        ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("Hello there")}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4}}))
        events = until(_Plain(ws))
        assert events[-1]["response"]["status"] == "incomplete"
        assert said(events)[0]


def test_a_model_that_does_not_hear_refuses_a_spoken_turn(base: str) -> None:
    """The tiny demo reads text only: a committed turn of audio is a conversation item, and the
    response over it is refused (an error naming the part), the session going on."""
    with connect(ws_url(base)) as ws:
        json.loads(ws.recv())
        silence = base64.b64encode(bytes(4800)).decode()  # 100 ms
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        committed, added, done = (json.loads(ws.recv()) for _ in range(3))
        assert committed["type"] == "input_audio_buffer.committed"
        assert added["item"]["id"] == committed["item_id"] == done["item"]["id"]
        ws.send(json.dumps({"type": "response.create", "event_id": "r1"}))
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["error"]["event_id"] == "r1"
        assert "audio" in error["error"]["message"], error


def test_a_cancelled_response_ends_cancelled_and_frees_every_stage(base: str) -> None:
    with sdk(base).realtime.connect(model=MODEL) as conn:
        until(conn, "session.created")
        conn.send({"type": "conversation.item.create", "item": user_text("Hello there")})
        conn.send({"type": "response.create", "response": {"max_output_tokens": LONG}})
        until(conn, "response.output_audio.delta")
        conn.send({"type": "response.cancel"})
        done = until(conn)[-1]["response"]
        assert done["status"] == "cancelled"
        assert done["status_details"]["reason"] == "client_cancelled"
        assert done["output"][0]["status"] == "incomplete"
        conn.send({"type": "conversation.item.create", "item": user_text("Again")})
        conn.send({"type": "response.create", "response": {"max_output_tokens": 4}})
        again = until(conn)[-1]["response"]
        assert again["status"] == "incomplete"
        # The cancelled response left its sequence, as far as it got: the next turn reuses it.
        assert again["usage"]["input_token_details"]["cached_tokens"] > 0


def answer_until_it_speaks(ws: Any, tokens: int = LONG) -> None:
    """Ask a plain socket's session for an answer of `tokens`; return at its first audio."""
    ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("Hello there")}))
    ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": tokens}}))
    while json.loads(ws.recv())["type"] != "response.output_audio.delta":
        pass


def test_a_dropped_socket_aborts_its_response(base: str) -> None:
    """Every stage lets go of the response, and the thinker of the session's sequence (which
    the cancelled response left, and the session's end took back)."""
    idle, kept = gauges([base]), kept_sequences(base)
    with connect(ws_url(base)) as ws:
        json.loads(ws.recv())
        answer_until_it_speaks(ws)
    settle([base], idle)
    wait_for(lambda: kept_sequences(base) == kept, 10, "the session's sequence to be given up")


def test_sessions_beyond_the_limit_are_refused_at_the_upgrade(base: str) -> None:
    with connect(ws_url(base)) as a, connect(ws_url(base)) as b:
        for ws in (a, b):
            assert json.loads(ws.recv())["type"] == "session.created"
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(base))
        assert refused.value.response.status_code == 429
        assert b"most live sessions (2)" in refused.value.response.body
    with connect(ws_url(base)) as c:  # freed when the others closed
        assert json.loads(c.recv())["type"] == "session.created"


def test_server_vad_hears_two_turns_in_speech_silence_speech(base: str, speech: bytes) -> None:
    """Real Silero VAD on synthesised speech (espeak-ng), streamed in 100 ms pieces: each turn is
    started, stopped and committed under the id its start announced, and nothing else."""
    silence = bytes(48 * 1500)
    with connect(ws_url(base)) as ws:
        created = json.loads(ws.recv())["session"]
        assert created["audio"]["input"]["turn_detection"]["type"] == "server_vad"  # OpenAI's default
        turn = {"type": "server_vad", "create_response": False, "silence_duration_ms": 500}
        update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": turn}}}}
        ws.send(json.dumps(update))
        assert json.loads(ws.recv())["type"] == "session.updated"
        stream_audio(ws, speech + silence + speech + silence)
        events = [json.loads(ws.recv()) for _ in range(2 * 5)]
    kinds = [e["type"] for e in events]
    one_turn = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert kinds == one_turn * 2
    first, second = events[:5], events[5:]
    for turn_events in (first, second):
        ids = {e.get("item_id") or e["item"]["id"] for e in turn_events}
        assert len(ids) == 1
    assert first[0]["audio_start_ms"] < first[1]["audio_end_ms"] < second[0]["audio_start_ms"]
    assert second[0]["audio_start_ms"] >= len(speech) // 48 + 1000  # in the second speech, not the silence


def test_speech_during_a_response_cancels_it(base: str, speech: bytes) -> None:
    """Barge-in: the user speaks while the answer is playing; the response ends `cancelled`
    (turn_detected) at once, its stages' work aborted, and the turn is heard as the next."""
    with connect(ws_url(base)) as ws:
        json.loads(ws.recv())
        answer_until_it_speaks(ws)
        stream_audio(ws, speech)
        seen = []
        while (event := json.loads(ws.recv()))["type"] != ENDS:
            seen.append(event["type"])
        assert "input_audio_buffer.speech_started" in seen
        assert event["response"]["status"] == "cancelled"
        assert event["response"]["status_details"]["reason"] == "turn_detected"


def stream_audio(ws: Any, pcm: bytes) -> None:
    for at in range(0, len(pcm), 4800):  # 100 ms
        ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[at : at + 4800]).decode()}
            )
        )


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Two seconds of English from espeak-ng (Debian's), as 24 kHz PCM16."""
    wav = tmp_path_factory.mktemp("speech") / "hello.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "Hello, how are you doing today?"], check=True)
    samples, rate = soundfile.read(wav, dtype="float32")
    return (np.clip(soxr.resample(samples, rate, 24000), -1, 1) * 32767).astype("<i2").tobytes()


def test_a_message_over_the_size_limit_closes_the_socket(base: str) -> None:
    with connect(ws_url(base), max_size=None) as ws:
        json.loads(ws.recv())
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1 << 20)}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_another_models_name_is_refused_at_the_upgrade(base: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect(f"{base.replace('http://', 'ws://')}/v1/realtime?model=gpt-realtime")
    assert refused.value.response.status_code == 404


class _Plain:
    """A websockets connection read as the SDK's is, for `until`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    def recv(self) -> dict[str, Any]:
        return json.loads(self.ws.recv())


def speech_endpoint(base: str, text: str) -> bytes:
    """`POST /v1/audio/speech` of `text` as raw PCM, with the openai SDK."""
    return sdk(base).audio.speech.create(model=MODEL, voice="alloy", input=text, response_format="pcm").read()


def speech_socket(base: str) -> Any:
    return connect(f"{base.replace('http://', 'ws://')}/v1/audio/speech/stream")


def test_the_speech_stream_socket_speaks_what_the_speech_endpoint_speaks(base: str) -> None:
    """vLLM-Omni's text-in speech-out socket: text in pieces, flushed by input.done, comes back
    as the speech endpoint's audio for the same text; the socket stays open for the next."""
    with speech_socket(base) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "alloy", "response_format": "pcm"}))
        for utterance in range(2):
            ws.send(json.dumps({"type": "input.text", "text": "Hello "}))
            ws.send(json.dumps({"type": "input.text", "text": "there."}))
            ws.send(json.dumps({"type": "input.done"}))
            start, audio, done, flushed = (ws.recv() for _ in range(4))
            assert json.loads(start) == {
                "type": "audio.start",
                "utterance_index": utterance,
                "sentence_index": 0,
                "sentence_text": "Hello there.",
                "format": "pcm",
            }
            assert audio == speech_endpoint(base, "Hello there.")
            assert json.loads(done) == {
                "type": "audio.done",
                "utterance_index": utterance,
                "sentence_index": 0,
                "total_bytes": len(audio),
            }
            assert json.loads(flushed) == {
                "type": "session.done",
                "utterance_index": utterance,
                "total_sentences": 1,
            }


def test_the_speech_stream_socket_speaks_each_sentence_as_its_text_ends(base: str) -> None:
    """`split_granularity: sentence` with `stream_audio`: a sentence is spoken once its end has
    come, before the flush, its PCM streamed as it is made."""
    with speech_socket(base) as ws:
        config = {
            "type": "session.config",
            "split_granularity": "sentence",
            "stream_audio": True,
            "response_format": "pcm",
        }
        ws.send(json.dumps({**config, "voice": "alloy"}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there. And"}))
        start = json.loads(ws.recv())
        assert start["sentence_text"] == "Hello there." and start["sample_rate"] == 24000
        pcm = b""
        while isinstance(frame := ws.recv(), bytes):
            pcm += frame
        assert json.loads(frame)["type"] == "audio.done"
        assert pcm == speech_endpoint(base, "Hello there.")
        ws.send(json.dumps({"type": "input.text", "text": " then?"}))
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv())["sentence_text"] == "And then?"
        while isinstance(frame := ws.recv(), bytes):
            pass
        assert json.loads(ws.recv()) == {"type": "session.done", "utterance_index": 0, "total_sentences": 2}


def test_the_speech_stream_socket_refuses_what_it_cannot_do_and_goes_on(base: str) -> None:
    with speech_socket(base) as ws:
        cases = [
            ({"type": "input.text", "text": "early"}, "Expected session.config"),
            (
                {"type": "session.config", "ref_audio": "data:audio/wav;base64,AAAA"},
                "ref_audio: model 'tiny-omni' clones no voice",
            ),
            ({"type": "session.config", "voice": "nobody"}, "voice 'nobody'"),
            ({"type": "session.config", "response_format": "mp3"}, "'mp3' is not served"),
            ({"type": "session.config", "stream_audio": True}, "stream_audio requires response_format 'pcm'"),
            ({"type": "session.config", "word_timestamps": True}, "no forced aligner"),
            ({"type": "session.config", "volume": 3}, "volume"),
        ]
        for message, says in cases:
            ws.send(json.dumps(message))
            error = json.loads(ws.recv())
            assert error["type"] == "error" and says in error["message"], (message, error)
        ws.send(json.dumps({"type": "session.config", "response_format": "wav"}))
        ws.send(json.dumps({"type": "input.text", "text": "Fine."}))
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv())["format"] == "wav"
        assert ws.recv()[:4] == b"RIFF"
        ws.send(json.dumps({"type": "session.close"}))


def test_a_stage_killed_mid_response_and_the_session_goes_on(base: str) -> None:
    """SIGKILL of the talker while a live response speaks: the response is run again on a fresh
    route (the supervisor restarts the talker) or ends `failed` with the reason, never hangs;
    the session then answers its next turn, and nothing is left held. (Last in this module: it
    restarts a replica the others share.)"""
    [talker] = replicas(base, "talker")
    with connect(ws_url(base)) as ws:
        json.loads(ws.recv())
        answer_until_it_speaks(ws, tokens=200)
        os.kill(talker["pid"], signal.SIGKILL)
        done = until(_Plain(ws))[-1]["response"]
        assert done["status"] in ("incomplete", "failed"), done  # 200 tokens: incomplete if it went on
        if done["status"] == "failed":
            assert "talker" in done["status_details"]["error"]["message"], done
        wait_for(
            lambda: [r["pid"] for r in replicas(base, "talker")] not in ([], [talker["pid"]]),
            60,
            "a new talker",
        )
        ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("Again")}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4}}))
        assert until(_Plain(ws))[-1]["response"]["status"] == "incomplete"


def test_keys_idle_sessions_and_shutdown(
    demo_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway with API keys takes a socket's key from its Authorization header or, as browsers
    send it, from the `openai-insecure-api-key.<key>` subprotocol, and refuses a socket without
    one (401); it closes a session idle past `idleTimeoutS` (1000), and at shutdown closes the
    sessions still open with 1001 and a reason (a duplex session says session.closed first)."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())
    spec["spec"]["gateway"]["realtime"] = {"idleTimeoutS": 3}
    pipeline = demo_dir / "tiny-omni-realtime-keys.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("OMNI_API_KEYS", "sesame")
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (serve, base):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(base))
        assert refused.value.response.status_code == 401
        with connect(ws_url(base), additional_headers={"Authorization": "Bearer sesame"}) as ws:
            assert json.loads(ws.recv())["type"] == "session.created"
            with pytest.raises(ConnectionClosedOK) as idle:
                while True:
                    ws.recv()
            assert idle.value.rcvd.code == 1000 and idle.value.rcvd.reason == "session idle"
        browser = connect(ws_url(base), subprotocols=["realtime", "openai-insecure-api-key.sesame"])
        duplex = connect(f"{ws_url(base)}&duplex=1", additional_headers={"Authorization": "Bearer sesame"})
        with browser as ws, duplex:
            assert ws.subprotocol == "realtime"
            assert json.loads(ws.recv())["type"] == "session.created"
            assert json.loads(duplex.recv())["type"] == "session.created"  # opened by ?model=
            serve.interrupt_group()
            for socket in (ws, duplex):
                with pytest.raises(ConnectionClosed) as shut:
                    while True:
                        last = json.loads(socket.recv())
                assert shut.value.rcvd is not None and shut.value.rcvd.code == 1001
                assert shut.value.rcvd.reason == "the gateway is shutting down"
            assert last == {**last, "type": "session.closed", "reason": "server_shutdown"}


def duplex_url(base: str) -> str:
    """As vLLM-Omni's DuplexClient connects: the session opens with its first message. (A socket
    a test stops reading mid-answer is opened with `max_queue=None`: websockets' client stops
    reading at a full queue, and its close would then wait out its 10 s close timeout for the
    server's reply.)"""
    return f"{ws_url(base)}&duplex=1&autostart=0"


def open_duplex(ws: Any, **session: Any) -> dict[str, Any]:
    """A plain socket's duplex session, opened with `session.update` as vLLM-Omni's clients open
    one; its session.created."""
    ws.send(json.dumps({"type": "session.update", "session": {"model": MODEL, **session}}))
    created = json.loads(ws.recv())
    assert created["type"] == "session.created", created
    return created


def say(ws: Any, text: str) -> None:
    """A typed turn (input.text.append), committed: answered by itself (auto_response)."""
    ws.send(json.dumps({"type": "input.text.append", "text": text}))
    ws.send(json.dumps({"type": "input_audio_buffer.commit"}))


def resume(ws: Any, created: dict[str, Any], token: str, last_seq: int) -> dict[str, Any]:
    """The session of `created` resumed on socket `ws`: the server's first answer."""
    session_id = created["session"]["id"]
    resumed = {"session_id": session_id, "resume_token": token, "last_received_server_event_seq": last_seq}
    ws.send(json.dumps({"type": "session.resume", **resumed}))
    return dict(json.loads(ws.recv()))


def test_a_duplex_session_resumes_on_a_new_socket_with_what_it_missed(base: str) -> None:
    """A duplex session outlives its socket: the answer goes on while it is away, and a new
    socket resuming it (its token, the last event it got) gets session.resumed with a new token,
    then every event it missed, in order, each once; the old token is spent. A resume while a
    socket is attached takes the session over (the old socket is told, and closed); and
    session.close ends it (session.closed, the socket closed 1000), every stage letting go."""
    with connect(duplex_url(base), max_queue=None) as ws:
        created = open_duplex(ws, modalities=["text"], max_output_tokens=400)
        assert created["session"]["capabilities"]["implementation_level"] == "turn_based_duplex"
        say(ws, "Hello there")
        seen = []
        while (event := json.loads(ws.recv()))["type"] != "response.output_text.delta":
            seen.append(event)
        seen.append(event)
    # No session.close: the socket dropped, and the session waits for its resume.
    numbers = [e["server_event_seq"] for e in seen]
    assert numbers == list(range(1, len(seen) + 1))
    assert [e["type"] for e in seen][:4] == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    assert seen[3]["response_id"] == seen[3]["response"]["id"]  # the dialect's top-level id

    with connect(duplex_url(base)) as again:
        resumed = resume(again, created, created["resume_token"], numbers[-1])
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["attachment_generation"] == 2
        assert resumed["resume_token"] != created["resume_token"]
        rest = until(_Plain(again))
        after = numbers[-1] + 1
        assert [e["server_event_seq"] for e in rest] == list(range(after, after + len(rest)))
        text = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
        assert rest[-1]["response"]["output"][0]["content"][0]["text"] == text
        last = rest[-1]["server_event_seq"]
        again.send(json.dumps({"type": "session.event_ack", "server_event_seq": last}))

        with connect(duplex_url(base)) as spent:
            refused = resume(spent, created, created["resume_token"], 0)
            assert refused["type"] == "error" and refused["error"]["code"] == "invalid_resume_token"

        with connect(duplex_url(base)) as taker:
            taken = resume(taker, created, resumed["resume_token"], last)
            assert taken["type"] == "session.resumed" and taken["attachment_generation"] == 3
            assert json.loads(again.recv())["type"] == "session.replaced"
            with pytest.raises(ConnectionClosedOK):
                again.recv()
            taker.send(json.dumps({"type": "session.close"}))
            closed = json.loads(taker.recv())
            assert closed["type"] == "session.closed" and closed["reason"] == "client_close"
            with pytest.raises(ConnectionClosedOK) as ended:
                taker.recv()
            assert ended.value.rcvd is not None and ended.value.rcvd.code == 1000


def live_sessions(base: str) -> float:
    name = "omni_gateway_realtime_sessions"
    return metric_values(f"{base}/metrics", (name,))[name]


def test_a_duplex_session_not_resumed_in_time_ends_and_frees_everything(base: str) -> None:
    """Its socket dropped mid-answer and no resume within `resumeGraceS`: the session ends, its
    answer aborted at every stage, its slot and sequence given back; then it cannot be resumed."""
    idle, kept = gauges([base]), kept_sequences(base)
    with connect(duplex_url(base), max_queue=None) as ws:
        created = open_duplex(ws, modalities=["text"], max_output_tokens=LONG)
        say(ws, "Hello there")
        while json.loads(ws.recv())["type"] != "response.output_text.delta":
            pass
    wait_for(lambda: live_sessions(base) == 0, 10 * GRACE, "the session to end")
    settle([base], idle)
    wait_for(lambda: kept_sequences(base) == kept, 10, "the session's sequence to be given up")
    with connect(duplex_url(base)) as gone:
        refused = resume(gone, created, created["resume_token"], 0)
        assert refused["type"] == "error" and refused["error"]["code"] == "session_resume_expired"


def test_a_duplex_session_refuses_what_it_cannot_do_and_goes_on(base: str) -> None:
    """A field the session cannot honour is an error that names it: in the first session.update,
    no session opens (the socket closes, 1008); later, the session goes on. (`/v1/duplex` is
    the same socket as `/v1/realtime?duplex=1`.)"""
    with connect(f"{base.replace('http://', 'ws://')}/v1/duplex?model={MODEL}&autostart=0") as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"model": MODEL, "ref_audio": "x"}}))
        error = json.loads(ws.recv())
        assert error["type"] == "error" and error["error"]["param"] == "session.ref_audio"
        with pytest.raises(ConnectionClosed) as refused:
            ws.recv()
        assert refused.value.rcvd is not None and refused.value.rcvd.code == 1008
    with connect(duplex_url(base)) as ws:
        open_duplex(ws, sample_rate_hz=16000)
        piece = base64.b64encode(bytes(3200)).decode()  # 100 ms at 16 kHz
        bad = {"type": "input_audio_buffer.append", "audio": piece, "sample_rate_hz": 24000, "event_id": "a"}
        ws.send(json.dumps(bad))
        error = json.loads(ws.recv())["error"]
        assert error["param"] == "sample_rate_hz" and error["event_id"] == "a", error
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece, "video_frames": ["x"]}))
        assert json.loads(ws.recv())["error"]["param"] == "video_frames"
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece, "is_speech": False}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))  # only what is not speech
        listen = json.loads(ws.recv())
        assert listen["type"] == "response.listen", listen
        assert listen["response"]["metadata"]["reason"] == "not_speech"
        ws.send(json.dumps({"type": "session.heartbeat"}))
        assert json.loads(ws.recv())["type"] == "session.heartbeat_ack"
