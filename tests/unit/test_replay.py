"""A re-run's outputs spliced onto what a client already has: nothing twice, nothing missing,
and a re-run that does not repeat what was sent is refused rather than spliced."""

from __future__ import annotations

import numpy as np
import pytest

from omni_gateway.events import AudioChunk, Event, Finished, ImageProgress, TextDelta
from omni_gateway.replay import AUDIO_CHECKED, Delivered, Diverged
from omni_pipeline.control import TokenLogprob, ToolCall


def delivered(*events: Event) -> Delivered:
    d = Delivered()
    for ev in events:
        d.record(ev)
    return d


def spliced(d: Delivered, *events: Event) -> list[Event]:
    """What a re-run of `events` sends on, recorded as delivered as it goes (as the gateway does)."""
    splice = d.splice()
    out = [new for ev in events if (new := splice(ev)) is not None]
    for ev in out:
        d.record(ev)
    return out


def lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, -0.5)


def test_text_goes_on_where_the_client_is() -> None:
    d = delivered(TextDelta("hel"), TextDelta("lo wor"))
    out = spliced(d, TextDelta("hello"), TextDelta(" world"), TextDelta("!"), Finished("stop", {}))
    assert out == [TextDelta("ld"), TextDelta("!"), Finished("stop", {})]


def test_logprobs_already_sent_are_dropped_with_their_text() -> None:
    d = delivered(TextDelta("ab", [lp("a"), lp("b")]))
    out = spliced(d, TextDelta("a", [lp("a")]), TextDelta("bc", [lp("b"), lp("c")]))
    assert out == [TextDelta("c", [lp("c")])]


def test_a_rerun_with_other_text_is_refused() -> None:
    d = delivered(TextDelta("hello"))
    with pytest.raises(Diverged, match="'help ' where 'hello' was sent"):
        spliced(d, TextDelta("help me"))


def test_a_rerun_that_ends_short_is_refused() -> None:
    d = delivered(TextDelta("hello world"))
    with pytest.raises(Diverged, match="ended before"):
        spliced(d, TextDelta("hello"), Finished("stop", {}))


def test_audio_goes_on_from_the_next_sample() -> None:
    wave = np.sin(np.arange(3000, dtype=np.float32) / 10)
    d = delivered(AudioChunk(wave[:1000], 24000), AudioChunk(wave[1000:1700], 24000))
    # Another replica's batch sums in another order: off by far less than the tolerance.
    again = wave + np.float32(1e-5)
    chunks = [AudioChunk(again[i : i + 600], 24000) for i in range(0, 3000, 600)]
    out = spliced(d, *chunks)
    assert [len(c.samples) for c in out if isinstance(c, AudioChunk)] == [100, 600, 600]
    assert np.array_equal(np.concatenate([c.samples for c in out]), again[1700:])  # type: ignore[union-attr]
    assert d.samples == 3000


def test_audio_that_differs_where_it_was_sent_is_refused() -> None:
    wave = np.zeros(AUDIO_CHECKED * 2, np.float32)
    d = delivered(AudioChunk(wave, 24000))
    other = wave.copy()
    other[-10] = 0.5  # inside the tail the splice checks
    with pytest.raises(Diverged, match=r"differs from what was sent by up to 0\.5"):
        spliced(d, AudioChunk(other, 24000))


def test_image_previews_already_shown_are_skipped() -> None:
    img = [np.zeros((2, 2, 3), np.uint8)]
    d = delivered(ImageProgress(1, img, False), ImageProgress(2, img, False))
    out = spliced(d, ImageProgress(1, img, False), ImageProgress(2, img, False), ImageProgress(3, img, True))
    assert [e.step for e in out if isinstance(e, ImageProgress)] == [3]


def test_tool_calls_already_sent_cannot_be_spliced() -> None:
    d = delivered(TextDelta("", tool_calls=[ToolCall("call_1", "f", "{}")]))
    with pytest.raises(Diverged, match="tool calls"):
        d.splice()
