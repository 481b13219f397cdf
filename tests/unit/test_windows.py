"""Windows, segmentation and input assembly: exactly the expected engine triggers."""

from __future__ import annotations

import pytest
import torch

from omni_stage.assembly import AssemblyError, InputAssembler
from omni_stage.payload import concat, split
from omni_stage.segments import EngineOutput, Segmenter
from omni_stage.windows import WindowState


def tokens(a: int, b: int) -> dict[str, torch.Tensor]:
    return {"token_ids": torch.arange(a, b)}


def run_window(window: int, segments: list[int], first: int | None = None) -> list[tuple[int, bool]]:
    ws = WindowState(window, first)
    out = []
    start = 0
    for i, n in enumerate(segments):
        last = i == len(segments) - 1
        for c in ws.push(tokens(start, start + n) if n else {}, n, last):
            out.append((c.units, c.is_last))
            if c.units:
                assert c.payload["token_ids"].tolist()[0] == sum(u for u, _ in out[:-1])
        start += n
    return out


@pytest.mark.parametrize(
    ("window", "segments", "expected"),
    [
        (-1, [4, 4, 4, 3], [(15, True)]),
        (8, [4, 4, 4, 3], [(8, False), (7, True)]),
        (8, [20], [(8, False), (8, False), (4, True)]),
        (8, [16], [(8, False), (8, True)]),
        (8, [16, 0], [(8, False), (8, False), (0, True)]),
        (25, [3], [(3, True)]),
        (1, [3], [(1, False), (1, False), (1, True)]),
        (-1, [0], [(0, True)]),
    ],
)
def test_window_chunks(window: int, segments: list[int], expected: list[tuple[int, bool]]) -> None:
    assert run_window(window, segments) == expected


@pytest.mark.parametrize(
    ("window", "first", "segments", "expected"),
    [
        (12, 1, [1, 8, 8, 8, 4], [(1, False), (12, False), (12, False), (4, True)]),
        (12, 1, [29], [(1, False), (12, False), (12, False), (4, True)]),
        (12, 1, [1], [(1, True)]),
        (12, 1, [1, 0], [(1, False), (0, True)]),
        (25, 1, [3, 40], [(1, False), (25, False), (17, True)]),
        (8, 8, [16], [(8, False), (8, True)]),
    ],
)
def test_a_first_window_cuts_the_first_chunk_sooner(
    window: int, first: int, segments: list[int], expected: list[tuple[int, bool]]
) -> None:
    """`firstWindow`: the first chunk of a request's stream that many units, then `window` each."""
    assert run_window(window, segments, first) == expected


def test_a_streams_context_comes_with_its_first_window_not_in_its_stead() -> None:
    """A cloned voice's clip codes lead its codes as context (`Codes.context`): the first window
    (1) counts the codes after them, so the first voiced code goes with the context at once,
    rather than after the next whole window; the windows after it as before."""
    context = {"codes": torch.zeros(30, 16), "context": 30}
    ws = WindowState(25, first=1)
    assert ws.push(context, 30, False) == []  # nothing voiced yet: nothing to hand over
    first = ws.push({"codes": torch.ones(1, 16)}, 1, False)
    assert [(c.units, c.payload["codes"].shape[0], c.payload["context"]) for c in first] == [(31, 31, 30)]
    assert [c.units for c in ws.push({"codes": torch.ones(25, 16)}, 25, False)] == [25]


def test_the_first_segment_counts_its_units_after_a_streams_context() -> None:
    seg = Segmenter(max_units=8, flush_interval_s=60, clock=lambda: 0.0, first_units=1)
    assert seg.add(EngineOutput(30, data={"codes": torch.zeros(30, 16), "context": 30})) is None
    first = seg.add(EngineOutput(1, data={"codes": torch.ones(1, 16)}))
    assert first is not None and first.units == 31 and first.data["context"] == 30


def test_window_rejects_after_last() -> None:
    ws = WindowState(4)
    ws.push(tokens(0, 2), 2, True)
    with pytest.raises(RuntimeError):
        ws.push(tokens(2, 3), 1, False)


def test_split_and_concat_keep_metadata() -> None:
    p = {"audio": torch.arange(10.0), "sample_rate": 24000, "ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
    head, tail = split(p, 4)
    assert head["audio"].tolist() == [0, 1, 2, 3] and tail["ids"][0] == 5
    assert head["sample_rate"] == tail["sample_rate"] == 24000
    back = concat([head, tail])
    assert torch.equal(back["audio"], p["audio"]) and back["ids"] == p["ids"]


def test_segmenter_flushes_by_size_time_and_end() -> None:
    now = [0.0]
    seg = Segmenter(max_units=3, flush_interval_s=0.05, clock=lambda: now[0])
    out = [seg.add(EngineOutput(1, "a", tokens(i, i + 1))) for i in range(3)]
    assert out[:2] == [None, None] and out[2] is not None and out[2].units == 3 and out[2].text == "aaa"
    assert seg.add(EngineOutput(1, "b", tokens(3, 4))) is None
    now[0] = 1.0  # time passes: the next output flushes what is there
    s = seg.add(EngineOutput(1, "c", tokens(4, 5)))
    assert s is not None and s.units == 2 and s.sequence == 1
    last = seg.finish()
    assert last.is_last and last.units == 0 and last.sequence == 2


def test_the_first_segment_flushes_at_its_own_units() -> None:
    """`first_units` (a consumer's first window, or a client's first audio): the first segment goes
    out at that many units, the later ones at `max_units`."""
    seg = Segmenter(max_units=8, flush_interval_s=60, clock=lambda: 0.0, first_units=1)
    first = seg.add(EngineOutput(1, data=tokens(0, 1)))
    assert first is not None and first.units == 1 and first.sequence == 0
    assert [seg.add(EngineOutput(1, data=tokens(i, i + 1))) for i in range(1, 8)] == [None] * 7
    second = seg.add(EngineOutput(1, data=tokens(8, 9)))
    assert second is not None and second.units == 8


def test_assembly_windowed_edge_triggers_per_chunk_in_order() -> None:
    a: InputAssembler[str] = InputAssembler({"thinker": 8})
    assert a.add("thinker", 1, "c1", 8, False) == []  # out of order: held
    t = a.add("thinker", 0, "c0", 8, False)
    assert [x.inputs for x in t] == [{"thinker": "c0"}, {"thinker": "c1"}]
    t = a.add("thinker", 2, "c2", 3, True)
    assert [(x.inputs, x.is_last) for x in t] == [({"thinker": "c2"}, True)]
    assert a.done


def test_assembly_empty_last_chunk_ends_without_engine_call() -> None:
    a: InputAssembler[str] = InputAssembler({"talker": 25})
    a.add("talker", 0, "c0", 25, False)
    t = a.add("talker", 1, "empty", 0, True)
    assert len(t) == 1 and t[0].inputs == {} and t[0].is_last


def test_assembly_fan_in_of_full_windows_triggers_once() -> None:
    a: InputAssembler[str] = InputAssembler({"request": -1, "left": -1, "right": -1})
    assert a.add("request", 0, "req", 0, True) == []
    assert a.add("left", 0, "L", 5, True) == []
    t = a.add("right", 0, "R", 7, True)
    assert len(t) == 1 and t[0].is_last and t[0].inputs == {"request": "req", "left": "L", "right": "R"}


def test_assembly_refuses_duplicates_and_strangers() -> None:
    a: InputAssembler[str] = InputAssembler({"thinker": 4})
    a.add("thinker", 0, "x", 4, False)
    with pytest.raises(AssemblyError):
        a.add("thinker", 0, "x", 4, False)
    with pytest.raises(AssemblyError):
        a.add("talker", 0, "x", 4, False)
