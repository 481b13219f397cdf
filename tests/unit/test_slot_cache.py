"""The talkers' slot table (engines/slot_cache.py) against the plain forward it replaces: a
small Qwen2 decoder of transformers (random weights: what is compared is the cache, not the
model), each request's last hidden state after its steps on the table equal to the whole
sequence's forward, whichever slots step together."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Model

from omni_stage.engines.base import EngineError, InvalidRequest
from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.engines.slot_cache import WARM_UP_POSITIONS, SlotCache, SlotSteps, warm_up

WIDTH = 32  # the decoder's (tests/unit/conftest.py)


def whole(decoder: Qwen2Model, rows: torch.Tensor) -> torch.Tensor:
    """The last position's hidden state of a sequence's rows [1, n, WIDTH], computed at once."""
    return decoder(inputs_embeds=rows).last_hidden_state[0, -1]


@torch.inference_mode()
def test_steps_on_the_table_compute_what_each_whole_sequence_computes(decoder: Qwen2Model) -> None:
    """Three requests of 3, 7 and 5 prompt positions on a table of two slots of four positions:
    it grows for the third request and for the longer sequences, what the slots hold kept.
    Then steps of all three together, and of the first and third alone with the second's row
    between them not stepping; each request's hidden state equals its whole sequence's
    forward. A request's cache is copied once, at its prefill, never at a step."""
    table = SlotCache.of(decoder.config, 2, torch.float32, torch.device("cpu"), positions=4)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(1, n, WIDTH, generator=gen) for n in (3, 7, 5)]
    slots = [table.take() for _ in seqs]
    assert slots == [0, 1, 2]
    for slot, rows in zip(slots, seqs, strict=True):
        out = table.prefill(decoder, slot, None, torch.arange(rows.shape[1])[None], inputs_embeds=rows)
        torch.testing.assert_close(out.last_hidden_state[0, -1], whole(decoder, rows), rtol=0, atol=1e-6)

    def step(stepping: list[int]) -> None:
        new = torch.randn(len(stepping), 1, WIDTH, generator=gen)
        positions = torch.tensor([[table.lengths[s]] for s in stepping])
        out, rows = table.step(decoder, stepping, positions, inputs_embeds=new)
        for i, (s, row) in enumerate(zip(stepping, rows, strict=True)):
            seqs[s] = torch.cat([seqs[s], new[i : i + 1]], dim=1)
            expected = whole(decoder, seqs[s])
            torch.testing.assert_close(out.last_hidden_state[row, -1], expected, rtol=0, atol=1e-6)

    for _ in range(6):
        step([0, 1, 2])
    for _ in range(3):
        step([2, 0])  # slot 1 between them, not stepping
    step([1])
    assert table.lengths[:3] == [len(s[0]) for s in seqs] == [12, 14, 14]
    assert table.capacity == (4, 16) and table.grown == 3
    assert table.copies == 3  # the prefills'

    kept = table.kept(1)  # a conversation's sequence, out of its slot
    table.give_back(1)
    assert table.take() == 1  # the lowest free slot
    more = torch.randn(1, 2, WIDTH, generator=gen)
    out = table.prefill(decoder, 1, kept, torch.arange(14, 16)[None], inputs_embeds=more)
    expected = whole(decoder, torch.cat([seqs[1], more], dim=1))
    torch.testing.assert_close(out.last_hidden_state[0, -1], expected, rtol=0, atol=1e-6)
    assert table.lengths[1] == 16 and table.copies == 5


@torch.inference_mode()
def test_prompts_prefilled_together_into_their_slots_compute_what_each_alone_computes(
    decoder: Qwen2Model,
) -> None:
    """Prompts of 3, 7 and 5 positions prefilled together (`SlotSteps.prefill_together`, in
    forwards of at most 16 positions: the 7 alone, the 3 and the 5 together): each one's last
    position equals its whole sequence's forward, and a step of all three on the table after
    too; each cache copied once, into its slot. On a bounded table a batch holding a prompt past
    its positions is refused before any forward: nothing written."""
    table = SlotCache.of(decoder.config, 4, torch.float32, torch.device("cpu"), positions=8, grows=False)
    steps = SlotSteps(table, decoder)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randn(1, n, WIDTH, generator=gen) for n in (3, 7, 5)]
    slots = [table.take() for _ in seqs]
    spans = [torch.arange(s.shape[1])[None] for s in seqs]
    ends = steps.prefill_together(slots, spans, seqs, 16)
    assert [(e.row, e.last) for e in ends] == [(0, 2), (0, 6), (1, 4)]
    assert ends[0].output is ends[2].output is not ends[1].output  # two forwards
    for e, rows in zip(ends, seqs, strict=True):
        torch.testing.assert_close(
            e.output.last_hidden_state[e.row, e.last], whole(decoder, rows), rtol=0, atol=1e-6
        )
    assert table.lengths[:3] == [3, 7, 5] and table.copies == 3
    new = torch.randn(3, 1, WIDTH, generator=gen)
    out, rows = steps.step(slots, torch.tensor([[n] for n in (3, 7, 5)]), new)
    for i, row in enumerate(rows):
        expected = whole(decoder, torch.cat([seqs[i], new[i : i + 1]], dim=1))
        torch.testing.assert_close(out.last_hidden_state[row, -1], expected, rtol=0, atol=1e-6)
    for slot in slots:
        table.give_back(slot)
    a, b = table.take(), table.take()
    long = [torch.randn(1, n, WIDTH, generator=gen) for n in (2, 9)]
    with pytest.raises(
        InvalidRequest, match="the prompt takes 9 positions here, past this stage's maxModelLen of 8"
    ):
        steps.prefill_together([a, b], [torch.arange(n)[None] for n in (2, 9)], long, 32)
    assert table.lengths[a] == table.lengths[b] == 0 and table.copies == 3  # refused before its forward


@torch.inference_mode()
def test_fixed_shape_steps_compute_what_each_whole_sequence_computes(decoder: Qwen2Model) -> None:
    """The steps at fixed shapes (engines/fixed_steps.py: what `cudaGraphs` captures on CUDA),
    buckets 1 and 2, spans of 2 and 4 positions, on a table of two slots of four positions: a
    step of slot 0 alone (bucket 1, over the first two positions), of both (bucket 2, over
    four), past the table's positions (the table's own step; the table grows, and the buffers
    are built again for it, a span of 8 with them), of slot 1 alone (bucket 2, row 0 computed
    and dropped), and of three slots, past the last bucket (the table's own step). Each
    request's hidden state equals its whole sequence's forward."""
    table = SlotCache.of(decoder.config, 2, torch.float32, torch.device("cpu"), positions=4)
    steps = FixedSteps(table, decoder, 2, WIDTH, 0, capture=False, first_span=2)
    assert steps.buckets == (1, 2) and steps.spans == (2, 4) and not steps.captured
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randn(1, n, WIDTH, generator=gen) for n in (1, 3)]
    for rows in seqs:
        steps.prefill(table.take(), None, torch.arange(rows.shape[1])[None], rows)

    def step(stepping: list[int]) -> None:
        new = torch.randn(len(stepping), 1, WIDTH, generator=gen)
        positions = torch.tensor([[table.lengths[s]] for s in stepping])
        out, rows = steps.step(stepping, positions, new)
        for i, (s, row) in enumerate(zip(stepping, rows, strict=True)):
            seqs[s] = torch.cat([seqs[s], new[i : i + 1]], dim=1)
            expected = whole(decoder, seqs[s])
            torch.testing.assert_close(out.last_hidden_state[row, -1], expected, rtol=0, atol=1e-6)

    step([0])  # over 2 positions: slot 0 holds 1
    step([0, 1])  # over 4: slot 1 holds 3
    assert table.grown == 0 and steps.positions == 4
    step([1])  # slot 1 to 5 positions: the table's own step, and the table grows to 8
    assert table.grown == 1
    step([0, 1])
    assert steps.positions == 8 and steps.spans == (2, 4, 8)  # built again for the grown table
    step([1])  # bucket 2, row 0 computed and dropped
    seqs.append(torch.randn(1, 2, WIDTH, generator=gen))
    steps.prefill(table.take(), None, torch.arange(2)[None], seqs[2])
    step([0, 1, 2])  # past the last bucket
    step([2])
    assert table.lengths[:3] == [len(s[0]) for s in seqs] == [5, 8, 4]


@torch.inference_mode()
def test_a_bounded_table_never_grows_in_positions_and_refuses_a_longer_prompt(decoder: Qwen2Model) -> None:
    """A table of `maxModelLen` positions (`grows=False`), stepped at fixed shapes: a prompt
    past them is refused before its forward, with a 400 naming `maxModelLen`; a row stepped to
    the last position is `full` (a talker ends its request there) and equals its whole
    sequence's forward on the way; a step of it is a bug, not a growth. A full row still held,
    between two rows stepping, writes in the one position allocated past the others (the
    table's own step: past the last span), and what it holds stays. Its slots may still grow
    (more requests than `maxBatch`)."""
    table = SlotCache.of(decoder.config, 4, torch.float32, torch.device("cpu"), positions=6, grows=False)
    steps = FixedSteps(table, decoder, 4, WIDTH, 0, capture=False, first_span=2)
    assert table.positions == 6 and table.capacity == (4, 7) and steps.spans == (2, 4, 6)
    gen = torch.Generator().manual_seed(3)
    slots = [table.take() for _ in range(3)]
    with pytest.raises(
        InvalidRequest, match="the prompt takes 7 positions here, past this stage's maxModelLen of 6"
    ):
        steps.prefill(slots[1], None, torch.arange(7)[None], torch.randn(1, 7, WIDTH, generator=gen))
    assert table.lengths[slots[1]] == 0 and table.copies == 0  # refused before its forward

    seqs = [torch.randn(1, n, WIDTH, generator=gen) for n in (1, 4, 2)]
    for slot, rows in zip(slots, seqs, strict=True):
        steps.prefill(slot, None, torch.arange(rows.shape[1])[None], rows)

    def step(stepping: list[int]) -> None:
        new = torch.randn(len(stepping), 1, WIDTH, generator=gen)
        out, rows = steps.step(stepping, torch.tensor([[table.lengths[s]] for s in stepping]), new)
        for i, (s, row) in enumerate(zip(stepping, rows, strict=True)):
            seqs[s] = torch.cat([seqs[s], new[i : i + 1]], dim=1)
            expected = whole(decoder, seqs[s])
            torch.testing.assert_close(out.last_hidden_state[row, -1], expected, rtol=0, atol=1e-6)

    while not table.full(1):
        step([1])
    assert table.lengths[:3] == [1, 6, 2]
    with pytest.raises(AssertionError, match="a step of a full row"):
        step([1])
    held = table.kept(1)
    step([0, 2])  # slot 1 between them, full
    step([0, 2])
    for mine, kept in zip(table.kept(1).layers, held.layers, strict=True):
        assert torch.equal(mine.keys, kept.keys) and torch.equal(mine.values, kept.values)
    assert table.lengths[:3] == [3, 6, 4] and table.grown == 0
    table.take()
    assert table.take() == 4 and table.capacity == (8, 7)  # a fifth request: the slots grow


@torch.inference_mode()
def test_the_warm_up_runs_on_a_table_of_its_positions_and_names_maxmodellen_below_them(
    decoder: Qwen2Model,
) -> None:
    """A compiled talker's warm-up (`warm_up`: a request's life, a kept sequence's next turn)
    runs on a bounded table of WARM_UP_POSITIONS, every slot given back after; below them it
    is refused naming `maxModelLen`, not as a prompt of the warm-up's own a client never sent."""

    def positions(at: int, n: int) -> torch.Tensor:
        return torch.arange(at, at + n)[None]

    for bound, fixed in ((WARM_UP_POSITIONS, False), (WARM_UP_POSITIONS, True)):
        table = SlotCache.of(decoder.config, 4, torch.float32, torch.device("cpu"), bound, grows=False)
        steps = FixedSteps(table, decoder, 4, WIDTH, 0, capture=False) if fixed else SlotSteps(table, decoder)
        warm_up(steps, WIDTH, positions)
        assert table.taken == 0 and table.grown == 0
    table = SlotCache.of(
        decoder.config, 4, torch.float32, torch.device("cpu"), WARM_UP_POSITIONS - 1, grows=False
    )
    with pytest.raises(
        EngineError,
        match=f"maxModelLen of {WARM_UP_POSITIONS - 1} is below the {WARM_UP_POSITIONS} positions",
    ):
        warm_up(SlotSteps(table, decoder), WIDTH, positions)
