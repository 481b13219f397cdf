"""A talker's decode steps on its slot table at fixed shapes: what a CUDA graph replays.

A slot table's own step (`SlotCache.step`) attends over the rows and positions in use, so its
shapes change every step. Here a step's rows are padded up to a bucket of the table's first
rows (1, 2, 4, 8, ... up to the table's slots: a step's rows are its requests' slots, which
may lie above its batch size), and every row attends over a span of the
table's first positions (256, 512, ... doubling up to the table's: the shortest that holds
every row of the bucket), masked to its own length: the inputs, the position ids, the write
positions and the mask are buffers of the bucket's own, filled before each step, so that on
CUDA each bucket and span's forward is captured once, at start, as one graph, and replayed
(one launch a step instead of one a kernel: on an H200, eager, the talker's forwards were host
work, docs/benchmarks.md). The spans keep a step's attention to about what its rows hold, not
the whole table (a thinker's 4096 positions a slot, read every step, would be as many bytes
as its weights). Elsewhere the same fixed-shape forward runs as it is (the suite checks it
against the table's own step). A step of rows past the last bucket, or one that outgrows the
table's positions, takes the table's own step (`ran` counts the steps each way: `replayed`,
`fixed` launched, `own`); a table that grew is built again at its next step, and a bucket and
span its rows had outgrown then is captured when first used.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import torch

from omni_stage.engines.slot_cache import SlotCache, SlotSteps

LOG = logging.getLogger(__name__)
T = TypeVar("T")

BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes a fixed-shape step is padded up to: one fixed shape (and, on CUDA, one graph) each."""


FIRST_SPAN: Final = 256
"""The fewest positions a fixed-shape step attends over: the spans double from it to the table's."""


def buckets_up_to(most: int) -> tuple[int, ...]:
    """The buckets of steps of up to `most` rows (the last one itself)."""
    return tuple(sorted({b for b in BUCKETS if b < most} | {most}))


def spans_up_to(positions: int, first: int = FIRST_SPAN) -> tuple[int, ...]:
    """The spans of a table of `positions` a slot: doubling from `first`, the last the table's."""
    spans, span = [], first
    while span < positions:
        spans.append(span)
        span *= 2
    return (*spans, positions)


class FixedSteps(SlotSteps):
    """The decode steps of `model` on `table` at fixed shapes, by bucket (up to `rows`: the
    table's slots) and span (from `first_span` up); see the module's docstring. `inputs` go to
    every forward as they are (the part's own)."""

    def __init__(
        self,
        table: SlotCache,
        model: Any,
        rows: int,
        width: int,
        position_rows: int,
        capture: bool,
        first_span: int = FIRST_SPAN,
        ran: Counter[str] | None = None,
        **inputs: Any,
    ) -> None:
        super().__init__(table, model, ran, **inputs)
        self.buckets = buckets_up_to(rows)
        self.first_span = first_span
        self.width = width
        self.position_rows = position_rows
        """M-RoPE's rows of position ids (0: plain [batch, 1] ids)."""
        self.capture = capture
        self._build()

    @property
    def captured(self) -> bool:
        """Whether its steps replay as CUDA graphs."""
        return bool(self._graphs)

    def _build(self) -> None:
        """The buffers of each bucket (and, with `capture`, the graph of each bucket and span
        its rows fit), for the table as it is."""
        self.table.reserve(self.buckets[-1], 1)
        keys = self.table.layers[0].keys
        assert keys is not None
        device, self.positions = keys.device, self.table.positions
        self.spans = spans_up_to(self.positions, self.first_span)
        lead = (self.position_rows,) if self.position_rows else ()
        self._embeds = {b: keys.new_zeros(b, 1, self.width) for b in self.buckets}
        self._ids = {b: torch.zeros(*lead, b, 1, dtype=torch.long, device=device) for b in self.buckets}
        # Where each row writes: its length, also in the capture's own runs (a table built again
        # after it grew holds requests, whose positions before their lengths must stay: a span
        # its rows have outgrown is captured when a step first takes it, and they fit it).
        self._at = {b: torch.tensor(self.table.lengths[:b], device=device) for b in self.buckets}
        self._rows = {b: torch.arange(b, device=device) for b in self.buckets}
        self._span = torch.arange(self.positions, device=device)
        self._grown = self.table.grown
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]] = {}
        for b in self.buckets:
            for span in self.spans:
                if max(self.table.lengths[:b]) < span:
                    self._capture(b, span)

    def _capture(self, b: int, span: int) -> None:
        """With `capture`, the bucket and span's forward as a graph; a capture the device
        refuses ends the capturing: the steps launch at fixed shapes from then on."""
        if not self.capture:
            return
        try:
            self._graphs[b, span] = graphed(lambda: self._forward(b, span))
        except RuntimeError as exc:  # a kernel the capture refuses (MoE routing, say)
            LOG.warning("decode steps not captured as CUDA graphs, launched at fixed shapes: %s", exc)
            self._graphs, self.capture = {}, False

    def step(
        self, slots: list[int], positions: torch.Tensor, inputs_embeds: torch.Tensor
    ) -> tuple[Any, list[int]]:
        """As `SlotSteps.step`, at the bucket's fixed shapes (the table's first rows: a slot's
        row is the slot); the output is the step's own (copied out of a graph's, which its next
        replay overwrites)."""
        if self.table.grown != self._grown:
            self._build()  # (the table's tensors are new: every buffer and graph with them)
        height = max(slots) + 1
        b = next((b for b in self.buckets if b >= height), 0)
        longest = max(self.table.lengths[:b]) if b else self.positions  # (every row writes, stepping or not)
        span = next((s for s in self.spans if s > longest), 0)
        if not span:
            return super().step(slots, positions, inputs_embeds)
        embeds, ids = self._embeds[b], self._ids[b]
        embeds.zero_()
        embeds[slots] = inputs_embeds
        ids.zero_()
        ids[..., slots, :] = positions.to(ids.dtype)  # (a step's are whole numbers, if floats)
        self._at[b].copy_(torch.tensor(self.table.lengths[:b]), non_blocking=True)
        if self.capture and (b, span) not in self._graphs:
            self._capture(b, span)  # (a span the rows had outgrown when the table was built)
        if (b, span) in self._graphs:
            graph, out = self._graphs[b, span]
            graph.replay()
            out = _copied(out)
            self.ran["replayed"] += 1
        else:
            out = self._forward(b, span)
            self.ran["fixed"] += 1
        for s in slots:
            self.table.lengths[s] += 1
        return out, slots

    def _forward(self, b: int, span: int) -> Any:
        """The bucket's forward on its buffers: every row over the table's first `span`
        positions, masked to its own length and the position it writes."""
        at = self._at[b]
        visible = (self._span[None, :span] <= at[:, None])[:, None, None, :]  # [b, 1, 1, span]
        mask = visible
        if getattr(self.model.config, "_attn_implementation", "sdpa") == "eager":  # an additive mask
            dtype = self._embeds[b].dtype
            mask = torch.zeros(visible.shape, dtype=dtype, device=at.device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
        self.table.aim(0, span, self._rows[b], at)
        return self.model(
            inputs_embeds=self._embeds[b],
            position_ids=self._ids[b],
            attention_mask=mask,
            past_key_values=self.table,
            use_cache=True,
            **self.inputs,
        )


def graphed(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` (a forward on fixed buffers) as a CUDA graph, and what it returned, which each
    replay writes again. Run twice first on a side stream, as CUDA graphs want (caches
    allocate, kernels choose their algorithms); what a talker step's runs write lands in free
    rows (their lengths are 0) or past a held row's length, where its next step writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other engines' threads may run
        out = run()
    return graph, out


def _copied(out: Any) -> Any:
    """A model output's tensors (and tuples of them) copied; its cache (the table) as it is."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_copied(t) for t in out)
    if isinstance(out, Mapping):
        return type(out)(**{k: v if k == "past_key_values" else _copied(v) for k, v in out.items()})
    return out
