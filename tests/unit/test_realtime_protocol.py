"""The Realtime protocol's parts that need no socket: client events refused by name, the input
audio buffer's positions, a conversation's order, and cutting an assistant's item where the
client's playback stopped."""

from __future__ import annotations

import base64

import pytest

from omni_gateway.realtime.conversation import (
    BYTES_PER_MS,
    AudioBuffer,
    Conversation,
    ConversationItem,
    Part,
    decode_pcm,
    messages,
    truncate,
)
from omni_gateway.realtime.protocol import AudioAppend, RealtimeError, SessionUpdate, parse_event


@pytest.mark.parametrize(
    ("event", "param", "says"),
    [
        ('{"type":"session.update","session":{"tools":[]}}', "session.tools", "function calling"),
        (
            '{"type":"session.update","session":{"audio":{"input":{"turn_detection":{"type":"semantic_vad"}}}}}',
            "session.audio.input.turn_detection.type",
            "use server_vad",
        ),
        (
            '{"type":"session.update","session":{"audio":{"input":{"format":{"type":"audio/pcmu"}}}}}',
            "session.audio.input.format.type",
            "only audio/pcm at 24000 Hz",
        ),
        (
            '{"type":"session.update","session":{"audio":{"input":{"transcription":{"model":"whisper-1"}}}}}',
            "session.audio.input.transcription",
            "input transcription is not served",
        ),
        ('{"type":"input_audio_buffer.append","audio":5}', "audio", "Expected `str`"),
        (
            '{"type":"session.update","session":{"audio":{"input":{"turn_detection":{"type":"server_vad","threshold":1.5}}}}}',
            "session.audio.input.turn_detection.threshold",
            "< 1.0",
        ),
        ('{"type":"response.create","response":{"tools":[]}}', "response.tools", "function calling"),
        ('{"type":"conversation.item.create","item":{"type":"function_call"}}', "item.type", "Invalid"),
        ('{"type":"no.such.event"}', "type", "unknown event type 'no.such.event'"),
        ('{"event_id":"e1"}', "type", "every event names its type"),
    ],
)
def test_a_bad_event_is_refused_naming_its_field(event: str, param: str, says: str) -> None:
    with pytest.raises(RealtimeError) as refused:
        parse_event(event)
    assert refused.value.param == param
    assert says in refused.value.message


def test_a_session_update_leaves_unset_fields_unset_and_null_turns_detection_off() -> None:
    event = parse_event('{"type":"session.update","session":{"audio":{"input":{"turn_detection":null}}}}')
    assert isinstance(event, SessionUpdate)
    assert event.session.audio.input.turn_detection is None  # type: ignore[union-attr]
    assert isinstance(parse_event('{"type":"input_audio_buffer.append","audio":""}'), AudioAppend)


def test_audio_that_is_not_pcm16_is_refused() -> None:
    with pytest.raises(RealtimeError, match="not base64"):
        decode_pcm("not base64!", "audio")
    with pytest.raises(RealtimeError, match="odd number of bytes"):
        decode_pcm(base64.b64encode(b"abc").decode(), "audio")


def test_the_buffer_keeps_positions_of_all_the_audio_appended() -> None:
    buf = AudioBuffer(max_bytes=BYTES_PER_MS * 1000)
    buf.append(bytes(BYTES_PER_MS * 300))
    buf.keep_from(200)  # VAD: only the padding before speech stays
    assert (buf.start_ms, buf.end_ms, buf.size) == (200, 300, BYTES_PER_MS * 100)
    buf.append(b"\x01\x00" * (BYTES_PER_MS * 400 // 2))
    turn = buf.take(600)  # speech stopped at 600 ms
    assert len(turn) == BYTES_PER_MS * 400 and buf.start_ms == 600 and buf.end_ms == 700
    with pytest.raises(RealtimeError) as full:
        buf.append(bytes(BYTES_PER_MS * 1000))
    assert full.value.code == "input_audio_buffer_full"


def test_the_buffer_sends_each_turns_audio_ahead_once_from_its_start() -> None:
    """What goes ahead to be encoded: each piece once, at its place in the turn; once the
    buffer's start moves (VAD's trim, a commit, a clear), its turn is sent anew from 0."""
    buf = AudioBuffer(max_bytes=BYTES_PER_MS * 1000)
    buf.append(b"\x01\x00" * 10)
    assert buf.unsent() == (0, b"\x01\x00" * 10)
    assert buf.unsent() == (20, b"")
    buf.append(b"\x02\x00" * 5)
    assert buf.unsent() == (20, b"\x02\x00" * 5)
    buf.append(bytes(BYTES_PER_MS * 100))
    buf.keep_from(100)  # the turn now begins later: all it holds is unsent
    assert buf.unsent() == (0, bytes(buf.size))
    buf.append(b"\x03\x00")
    buf.take()
    buf.append(b"\x04\x00")
    assert buf.unsent() == (0, b"\x04\x00")


def test_items_go_where_the_client_puts_them_and_read_as_a_chat() -> None:
    chat = Conversation()
    a = ConversationItem("user", [Part("input_text", text="first")], id="a")
    b = ConversationItem(
        "assistant", [Part("output_audio", transcript="an answer", audio_bytes=48_000)], id="b"
    )
    c = ConversationItem("user", [Part("input_text", text="before all")], id="c")
    assert chat.add(a) is None
    assert chat.add(b) == "a"
    assert chat.add(c, "root") is None
    assert [i.id for i in chat.items] == ["c", "a", "b"]
    with pytest.raises(RealtimeError, match="already in the conversation"):
        chat.add(ConversationItem("user", [Part("input_text", text="x")], id="a"))
    with pytest.raises(RealtimeError) as missing:
        chat.add(ConversationItem("user", [Part("input_text", text="x")]), "nope")
    assert missing.value.param == "previous_item_id"
    assert messages("Be brief.", chat.items, max_media=8) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "before all"}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "an answer"},
    ]


def test_truncating_cuts_the_transcript_at_a_word_where_playback_stopped() -> None:
    item = ConversationItem(
        "assistant", [Part("output_audio", transcript="one two three four", audio_bytes=48_000)]
    )
    with pytest.raises(RealtimeError) as beyond:
        truncate(item, 0, 1001)
    assert beyond.value.param == "audio_end_ms"
    truncate(item, 0, 500)  # half of 1000 ms: 9 of 18 characters, back to a word's end
    assert item.parts[0].transcript == "one two"
    assert item.parts[0].audio_bytes == 500 * BYTES_PER_MS
    user = ConversationItem("user", [Part("input_text", text="hi")])
    with pytest.raises(RealtimeError, match="only an assistant's audio"):
        truncate(user, 0, 0)


def test_the_prompt_keeps_the_latest_turns_within_the_media_limit() -> None:
    """A long spoken conversation: its earlier turns drop out of the prompt (not out of the
    conversation) once its audio turns pass the gateway's media parts per request."""
    turns = [ConversationItem("user", [Part("input_audio", pcm=bytes(480))], id=f"u{i}") for i in range(3)]
    answer = ConversationItem("assistant", [Part("output_text", text="ok")], id="a")
    chat = messages("", [turns[0], answer, turns[1], turns[2]], max_media=2)
    assert [m["role"] for m in chat] == ["assistant", "user", "user"]  # u0 dropped
    assert len(messages("", [turns[0], answer, turns[1]], max_media=2)) == 3
