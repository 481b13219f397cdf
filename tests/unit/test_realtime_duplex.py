"""The full-duplex dialect's parts that need no socket: the journal a resume replays from, the
token it resumes with, the input resampled as it comes, and its client events refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from omni_gateway.audio import PcmResampler, to_pcm16
from omni_gateway.realtime.duplex_protocol import (
    DUPLEX_DECODER,
    DuplexAppend,
    DuplexCommit,
    DuplexSessionUpdate,
    PlaybackAck,
)
from omni_gateway.realtime.journal import Journal, ResumeToken
from omni_gateway.realtime.protocol import RealtimeError, parse_event


def test_the_journal_numbers_keeps_until_acknowledged_and_replays_what_was_missed() -> None:
    journal = Journal(max_bytes=1 << 20)
    sent = [journal.record({"type": "x", "n": n}) for n in range(5)]
    assert [f'"server_event_seq":{n + 1}' in text for n, text in enumerate(sent)] == [True] * 5
    assert journal.after(2) == sent[2:]
    journal.acknowledge(3)
    assert journal.after(3) == sent[3:] and journal.after(5) == []
    assert journal.after(2) is None  # acknowledged, so no longer kept: the client must resync
    with pytest.raises(ValueError, match="past the last event"):
        journal.acknowledge(6)
    journal.acknowledge(5)
    assert journal.kept_bytes == 0


def test_a_full_journal_stops_keeping_and_cannot_be_replayed() -> None:
    journal = Journal(max_bytes=200)
    journal.record({"type": "x", "pad": "a" * 100})
    assert not journal.overflowed
    journal.record({"type": "x", "pad": "a" * 100})
    assert journal.overflowed and journal.kept_bytes == 0
    assert '"server_event_seq":3' in journal.record({"type": "x"})  # still numbered
    assert journal.after(2) is None
    assert Journal(max_bytes=0).overflowed  # resumes turned off


def test_a_resume_token_matches_the_last_one_issued_and_knows_the_one_before() -> None:
    token = ResumeToken()
    assert not token.matches("")
    first = token.issue()
    assert token.matches(first) and not token.matches(first + "x")
    second = token.issue()
    assert token.matches(second) and not token.matches(first) and token.matches_previous(first)
    token.issue()
    assert not token.matches_previous(first)


@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_input_resampled_piece_by_piece_equals_the_whole_turn_resampled(rate: int) -> None:
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(rate * 2) * 3000).astype("<i2")
    resampler = PcmResampler(rate, 24000)
    pieces = [resampler.feed(pcm[at : at + 1601].tobytes()) for at in range(0, len(pcm), 1601)]
    streamed = b"".join(pieces) + resampler.flush()
    whole = to_pcm16(soxr.resample(pcm.astype(np.float32) / 32768.0, rate, 24000))
    assert streamed == whole
    assert resampler.flush() == b""  # nothing held back: the next turn starts afresh


def test_input_at_the_sessions_own_rate_passes_as_it_is() -> None:
    resampler = PcmResampler(24000, 24000)
    assert resampler.feed(b"\x01\x02\x03\x04") == b"\x01\x02\x03\x04" and resampler.flush() == b""


def test_vllm_omnis_session_update_and_events_parse() -> None:
    """The session.update vLLM-Omni's DuplexClient sends (its SessionConfig's payload, defaults)."""
    update = parse_event(
        b'{"type":"session.update","event_id":"e1","session":{"model":"m","modalities":["audio","text"],'
        b'"input_audio_format":"pcm16","output_audio_format":"pcm16","sample_rate_hz":16000,'
        b'"audio":{"input":{"sample_rate_hz":16000},"output":{"sample_rate_hz":24000}},'
        b'"turn_detection":null,"extra_body":{"auto_response":true}}}',
        DUPLEX_DECODER,
    )
    assert isinstance(update, DuplexSessionUpdate) and update.session.sample_rate_hz == 16000
    append = parse_event(
        b'{"type":"input_audio_buffer.append","audio":"","format":"pcm16","sample_rate_hz":16000,'
        b'"duration_ms":100,"audio_end_ms":100,"is_speech":false}',
        DUPLEX_DECODER,
    )
    assert isinstance(append, DuplexAppend) and append.is_speech is False
    commit = parse_event(b'{"type":"input_audio_buffer.commit","final":true}', DUPLEX_DECODER)
    assert isinstance(commit, DuplexCommit) and commit.response_create is None
    ack = parse_event(b'{"type":"playback.ack","played_ms":120,"committed_ms":120}', DUPLEX_DECODER)
    assert isinstance(ack, PlaybackAck) and ack.played_ms == 120


@pytest.mark.parametrize(
    ("event", "param"),
    [
        (b'{"type":"session.update","session":{"ref_audio":"data:"}}', "session.ref_audio"),
        (b'{"type":"session.update","session":{"sample_rate_hz":4000}}', "session.sample_rate_hz"),
        (b'{"type":"session.update","session":{"extra_body":{"seed":1}}}', "session.extra_body.seed"),
        (b'{"type":"session.update","session":{"overlap_policy":"shout"}}', "session.overlap_policy"),
        (b'{"type":"input_audio_buffer.append","audio":"","format":"g711_ulaw"}', "format"),
        (b'{"type":"input_audio_buffer.append","audio":"","video_frames":["x"]}', "video_frames"),
        (b'{"type":"playback.ack"}', "played_ms"),
        (b'{"type":"input.text.append","text":""}', "text"),
        (b'{"type":"turn.signal","event":"user_started"}', "type"),
    ],
)
def test_what_the_dialect_does_not_serve_is_refused_by_name(event: bytes, param: str) -> None:
    with pytest.raises(RealtimeError) as refused:
        parse_event(event, DUPLEX_DECODER)
    assert refused.value.param == param, refused.value.message
