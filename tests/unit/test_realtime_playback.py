"""What a live session keeps of an answer the user cut into (realtime/playback.py), driven
without a gateway: the client's playback acks checked and capped by what was sent, and the
cut at what was heard, by policy."""

from __future__ import annotations

import pytest

from omni_gateway.realtime.conversation import BYTES_PER_MS, ConversationItem, Part
from omni_gateway.realtime.duplex_protocol import PlaybackAck
from omni_gateway.realtime.playback import Playback
from omni_gateway.realtime.protocol import RealtimeError
from omni_gateway.realtime.response import Response


def answer(sent_ms: int, transcript: str = "one two three four") -> Response:
    part = Part("output_audio", transcript=transcript, audio_bytes=sent_ms * BYTES_PER_MS)
    item = ConversationItem("assistant", [part], id="item_resp_1")
    return Response("resp_1", ["audio"], None, None, None, True, item)


def test_an_ack_is_capped_by_what_was_sent_and_only_moves_forward() -> None:
    playback = Playback()
    playback.started(answer(1000))
    cursor = playback.ack(PlaybackAck(played_ms=1500, committed_ms=400, response_id="resp_1"))
    assert cursor == {
        "response_id": "resp_1",
        "item_id": "item_resp_1",
        "played_ms": 1000,
        "committed_ms": 400,
        "sent_ms": 1000,
    }
    assert playback.ack(PlaybackAck(played_ms=300))["committed_ms"] == 400  # never back


@pytest.mark.parametrize(
    ("ack", "code"),
    [
        (PlaybackAck(played_ms=10, response_id="resp_0"), "playback_item_not_found"),
        (PlaybackAck(played_ms=10, item_id="item_other"), "playback_item_mismatch"),
    ],
)
def test_an_ack_about_another_answer_is_refused(ack: PlaybackAck, code: str) -> None:
    playback = Playback()
    playback.started(answer(1000))
    with pytest.raises(RealtimeError) as err:
        playback.ack(ack)
    assert err.value.code == code


def test_no_answer_yet_refuses_an_ack() -> None:
    with pytest.raises(RealtimeError):
        Playback().ack(PlaybackAck(played_ms=0))


def test_a_cut_keeps_what_was_played() -> None:
    playback = Playback()
    r = answer(1000)
    playback.started(r)
    playback.ack(PlaybackAck(played_ms=500))
    assert playback.cut() == ("item_resp_1", 500)
    assert r.part.audio_bytes == 500 * BYTES_PER_MS and r.part.transcript == "one two"
    assert playback.cut() is None  # nothing more to cut


def test_without_an_ack_the_default_keeps_what_was_sent_and_ack_only_keeps_nothing() -> None:
    playback = Playback()
    playback.started(answer(1000))
    assert playback.cut() is None  # GA's behaviour: what was sent stays
    playback.policy = "ack_only"
    assert playback.cut() == ("item_resp_1", 0)
