"""A talker replica's KV cache, allocated once: one slot a request, each step written in place.

`kv_batch.decode_together` stacks every request's own `DynamicCache` into a batch and splits it
back at each step: a copy of every cache a step, and shapes and addresses that change, which a
CUDA graph cannot replay (docs/architecture.md, Talkers on GPUs). Here each layer's keys and
values are one tensor [slots, kv heads, positions, head dim] for the replica; a request takes a
slot before its prefill and gives it back when it ends. A prefill runs on the request's own
`DynamicCache` (a conversation's kept one, or a new one), copied into its slot once. A decode
step runs on the table's rows as they lie, from the lowest slot stepping to the highest (rows
between them not stepping are computed on zeros and dropped: slots are taken lowest first, so
they are few), writes each row's new position at that row's own length, in place, and attends
each row over its own length (a mask from the per-row lengths). The window a step sees is a
view of the table, so its strides stay as they were: a compiled step is not compiled again for
a new slot or length (its warm-up steps at the first three slots, so that the view's offset
into the table is compiled as a variable). A table built with its positions bounded (`grows`
false: a stage's `maxModelLen`) is allocated once: a prompt past them is refused, and a row
that holds them all is `full` (its request ends there, as at its `max_tokens`); one position
more is allocated, where a full row still held writes when a step spans it without stepping
it. Its slots may still grow. Otherwise it grows, by doubling, when a request outgrows it
(`grown` counts it). A request's cache is copied only into its slot at its prefill and out of
it for a conversation's kept sequence (`copies` counts those).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from omni_stage.engines.base import EngineError, InvalidRequest
from omni_stage.engines.kv_batch import by_length, prefill_together
from omni_stage.engines.last_logits import last_logits

FIRST_POSITIONS: Final = 512
"""Positions a slot holds at first in a table that grows: doubled when a request needs more."""
WARM_UP_POSITIONS: Final = 10
"""The positions `warm_up`'s longest request holds: a table bounded below them cannot run it."""


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values for every slot, and the window a step sees."""

    def __init__(
        self, table: SlotCache, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.table = table
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a slot table is allocated when it is built")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values ([rows, heads, 1, dim]) at each row's length, and
        return the window's: every row's positions up to the longest row's new end."""
        assert self.window is not None
        keys, values = self.window
        rows, at = self.table.rows_at
        keys[rows, :, at] = key_states[:, :, 0]
        values[rows, :, at] = value_states[:, :, 0]
        return keys, values

    def get_seq_length(self) -> int:
        return self.table.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.table.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def grow(self, slots: int, positions: int) -> None:
        """Reallocate at the larger capacity, what the slots hold copied over."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(slots, old.shape[1], positions, old.shape[3])
            new[: old.shape[0], :, : old.shape[2]] = old
            setattr(self, name, new)


class SlotCache(Cache):
    """A replica's slots; the module's docstring says how a step runs on them. Used from the
    compute thread (`take`, `prefill`, `step`), but `kept` and `give_back`, which may come from
    anywhere once no step of the slot's request can be in progress."""

    def __init__(
        self,
        layers: int,
        slots: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        positions: int = FIRST_POSITIONS,
        grows: bool = True,
    ) -> None:
        allocated = positions if grows else positions + 1
        shape = (slots, heads, allocated, head_dim)
        super().__init__(layers=[SlotLayer(self, shape, dtype, device) for _ in range(layers)])
        self.capacity = (slots, allocated)
        self.bound = None if grows else positions
        """The positions a request may hold (None: the table doubles when one needs more)."""
        self.lengths = [0] * slots
        self._free = list(range(slots))
        self.seen = 0
        """The longest row's length before this step (transformers' past length)."""
        self.rows_at: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(0), torch.zeros(0))
        self.grown = 0
        self.copies = 0

    def take(self) -> int:
        """A free slot, the lowest (the rows a step spans stay few), its length 0."""
        if not self._free:
            slots, positions = self.capacity
            self._grow(slots * 2, positions)
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def full(self, slot: int) -> bool:
        """Whether the slot's row holds every position of a table that does not grow: its
        request can take no further step."""
        return self.bound is not None and self.lengths[slot] >= self.bound

    @property
    def positions(self) -> int:
        """The positions a request may hold now."""
        return self.capacity[1] if self.bound is None else self.bound

    def give_back(self, slot: int) -> None:
        if slot not in self._free:
            self.lengths[slot] = 0  # (a step spanning it writes at its start)
            self._free.append(slot)

    @classmethod
    def of(
        cls,
        config: Any,
        slots: int,
        dtype: torch.dtype,
        device: torch.device,
        positions: int = FIRST_POSITIONS,
        grows: bool = True,
    ) -> SlotCache:
        """For a decoder of transformers' `config` (its layers, key-value heads, head size)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        return cls(layers, slots, heads, head_dim, dtype, device, positions, grows)

    @property
    def nbytes(self) -> int:
        """The table's keys and values, in bytes."""
        return sum(t.nbytes for layer in self.layers for t in (layer.keys, layer.values) if t is not None)

    @property
    def taken(self) -> int:
        return self.capacity[0] - len(self._free)

    def prefill(self, model: Any, slot: int, past: Any, positions: torch.Tensor, **inputs: Any) -> Any:
        """`model(**inputs)` for one request's n new positions ([1, n, ...]; `positions` its
        position ids, [1, n] or [k, 1, n] for M-RoPE's k rows) on `past` (a conversation's kept
        `DynamicCache`, or None), the whole sequence then copied into `slot`. Returns the
        model's output. On a table that does not grow, a sequence past its positions is the
        client's error, refused before the forward."""
        from transformers import DynamicCache

        self.check_fits((0 if past is None else past.get_seq_length()) + positions.shape[-1])
        positions = positions.contiguous()  # (as `step`'s: one layout whoever built them)
        out = model(**inputs, position_ids=positions, past_key_values=past or DynamicCache(), use_cache=True)
        self.put(slot, out.past_key_values)
        return out

    def prefill_together(
        self,
        model: Any,
        slots: list[int],
        positions: list[torch.Tensor],
        inputs_embeds: list[torch.Tensor],
        head: torch.nn.Module | None = None,
        **inputs: Any,
    ) -> Any:
        """`model(**inputs)` for prompts that each start a new cache (`inputs_embeds[i]` row i's,
        [1, n_i, H], `positions[i]` its position ids), in one forward
        (kv_batch.prefill_together, `head` as it says), each request's cache then copied into
        its slot. Every prompt is checked against the table's positions before the forward.
        Returns the model's output (row i's last position at n_i - 1)."""
        for p in positions:
            self.check_fits(p.shape[-1])
        out, caches = prefill_together(model, positions, inputs_embeds, "inputs_embeds", head, **inputs)
        for slot, cache in zip(slots, caches, strict=True):
            self.put(slot, cache)
        return out

    def check_fits(self, n: int) -> None:
        """A sequence of n positions past a bounded table's is the client's error, refused."""
        if self.bound is not None and n > self.bound:
            raise InvalidRequest(
                f"the prompt takes {n} positions here, past this stage's maxModelLen of {self.bound}"
            )

    def step(
        self, model: Any, slots: list[int], positions: torch.Tensor, **inputs: Any
    ) -> tuple[Any, list[int]]:
        """`model(**inputs)` for requests at their slots, one new position each: tensor `inputs`
        batched on dim 0 in the order of `slots`, `positions` their position ids in that order
        ([B, 1], or [k, B, 1]: built for the batch at once, not a tensor a request). Returns the
        model's output and each request's row of it."""
        # One layout whoever built them: a compiled model's guards see their strides.
        positions = positions.contiguous()
        if self.bound is not None:
            assert not any(self.full(s) for s in slots), "a step of a full row (its request ends at `full`)"
        lo, hi = min(slots), max(slots) + 1
        rows = [s - lo for s in slots]
        span = self.lengths[lo:hi]
        kv = max(span) + 1
        self.reserve(hi, kv)
        device = positions.device
        at = torch.tensor(span, device=device)
        self.aim(lo, kv, torch.arange(hi - lo, device=device), at)
        mask = None if hi - lo == 1 else torch.arange(kv, device=device)[None] <= at[:, None]
        if rows != list(range(hi - lo)):  # rows between the slots stepping: zeros
            inputs = {k: _spread(v, rows, hi - lo) if torch.is_tensor(v) else v for k, v in inputs.items()}
            joined = _spread_positions(positions, rows, hi - lo)
        else:
            joined = positions
        out = model(**inputs, attention_mask=mask, position_ids=joined, past_key_values=self, use_cache=True)
        for s in slots:
            self.lengths[s] += 1
        return out, rows

    def aim(self, lo: int, kv: int, rows: torch.Tensor, at: torch.Tensor) -> None:
        """What the next forward's layers see: the table's `len(rows)` rows from row `lo` up to
        position `kv`, and where each row writes its new position (`at`, [rows])."""
        hi = lo + rows.shape[0]
        self.seen = kv - 1
        self.rows_at = (rows, at)
        for layer in self.layers:
            assert isinstance(layer, SlotLayer) and layer.keys is not None and layer.values is not None
            layer.window = (layer.keys[lo:hi, :, :kv], layer.values[lo:hi, :, :kv])

    def reserve(self, slots: int, positions: int) -> None:
        """At least `slots` rows of at least `positions` positions (the table doubles to them)."""
        have_slots, have_positions = self.capacity
        assert self.bound is None or positions <= have_positions, "a bounded table does not grow"
        if slots > have_slots or positions > have_positions:
            self._grow(max(have_slots, slots), _doubled_to(have_positions, positions))

    def kept(self, slot: int) -> Any:
        """The slot's positions as a request's own `DynamicCache` (a conversation's kept
        sequence outlives its slot): a copy."""
        from transformers import DynamicCache

        n = self.lengths[slot]
        self.copies += 1
        data = []
        for layer in self.layers:
            assert layer.keys is not None and layer.values is not None
            keys, values = layer.keys[slot : slot + 1, :, :n], layer.values[slot : slot + 1, :, :n]
            data.append((keys.clone(), values.clone()))
        return DynamicCache(ddp_cache_data=data)

    def put(self, slot: int, past: Any) -> None:
        """A request's own cache (a prefill's, `prefill` or a batch's) into its slot, its length
        the cache's: a copy."""
        n = past.get_seq_length()
        self.reserve(slot + 1, n)
        self.copies += 1
        for layer, own in zip(self.layers, past.layers, strict=True):
            assert layer.keys is not None and layer.values is not None
            layer.keys[slot, :, :n] = own.keys[0]
            layer.values[slot, :, :n] = own.values[0]
        self.lengths[slot] = n

    def _grow(self, slots: int, positions: int) -> None:
        old_slots = self.capacity[0]
        self.capacity = (slots, positions)
        self._free.extend(range(old_slots, slots))
        self.lengths.extend([0] * (slots - old_slots))
        for layer in self.layers:
            assert isinstance(layer, SlotLayer)
            layer.grow(slots, positions)
        self.grown += 1


class SlotSteps:
    """A talker's decode steps on its table: `model`'s forward, with the talker's own `inputs`
    besides (`SlotCache.step`). `fixed_steps.FixedSteps` takes the same steps at fixed shapes.
    `ran` counts the steps by how they ran (`own`: on the table's own shapes): the part's,
    which outlives a table built again."""

    def __init__(self, table: SlotCache, model: Any, ran: Counter[str] | None = None, **inputs: Any) -> None:
        self.table = table
        self.model = model
        self.ran: Counter[str] = Counter() if ran is None else ran
        self.inputs = inputs

    def prefill(
        self,
        slot: int,
        past: Any,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        head: torch.nn.Module | None = None,
    ) -> Any:
        """The model's output for a prompt (or its rest, on `past`) at `slot`; with `head` (the
        model's logits' module), its logits the last position's alone (last_logits.py)."""
        inputs = {"inputs_embeds": inputs_embeds, **self.inputs}
        with last_logits(head):
            return self.table.prefill(self.model, slot, past, positions, **inputs)

    def prefill_together(
        self,
        slots: list[int],
        positions: list[torch.Tensor],
        inputs_embeds: list[torch.Tensor],
        budget: int,
        head: torch.nn.Module | None = None,
    ) -> list[PromptEnd]:
        """Prompts that start new caches, at `slots`, in forwards of prompts of about one length
        (kv_batch.by_length: `budget` positions a forward at most, padding included;
        `SlotCache.prefill_together`; `head` as `prefill`'s). Returns where each prompt's last
        position lies in the output of the forward that computed it."""
        ends: dict[int, PromptEnd] = {}
        for group in by_length([int(e.shape[1]) for e in inputs_embeds], budget):
            out = self.table.prefill_together(
                self.model,
                [slots[i] for i in group],
                [positions[i] for i in group],
                [inputs_embeds[i] for i in group],
                head,
                **self.inputs,
            )
            ends |= {
                i: PromptEnd(out, row, int(inputs_embeds[i].shape[1]) - 1) for row, i in enumerate(group)
            }
        return [ends[i] for i in range(len(slots))]

    def step(
        self, slots: list[int], positions: torch.Tensor, inputs_embeds: torch.Tensor
    ) -> tuple[Any, list[int]]:
        """The model's output for requests at `slots` stepping once, and each one's row of it."""
        self.ran["own"] += 1
        return self.table.step(self.model, slots, positions, inputs_embeds=inputs_embeds, **self.inputs)


class PromptEnd(NamedTuple):
    """A prompt prefilled with others: the output of the forward that computed it, its row
    there and its last position's index (the padding after it computed and meaningless; the
    logits, where a head was given, hold that position alone)."""

    output: Any
    row: int
    last: int


def _doubled_to(have: int, need: int) -> int:
    while have < need:
        have *= 2
    return have


def _spread(t: torch.Tensor, rows: list[int], height: int) -> torch.Tensor:
    """A batch's rows [B, ...] placed at `rows` of `height` rows, zeros between."""
    out = t.new_zeros(height, *t.shape[1:])
    out[rows] = t
    return out


def _spread_positions(joined: torch.Tensor, rows: list[int], height: int) -> torch.Tensor:
    """A batch's position ids ([..., B, n]) placed at `rows` of `height` rows, zeros between."""
    out = joined.new_zeros(*joined.shape[:-2], height, joined.shape[-1])
    out[..., rows, :] = joined
    return out


def warm_up(
    steps: SlotSteps, width: int, positions: Callable[[int, int], torch.Tensor], together: bool = False
) -> None:
    """Run a talker's steps (its model, on its table) on zeros of `width` through a request's
    life as the talker runs it: a prefill, a step alone, a step together with another request,
    a prefill on a kept sequence (a conversation's next turn); `together`, where prompts are
    prefilled together (`prefillBatchTokens`), two prompts in one forward too. What
    `torch.compile` wraps in it compiles now, at start, not at the first requests: so its
    inputs are laid out as requests' are (each its own contiguous tensor: a compiled form is
    guarded on strides). `positions(at, n)` gives the position ids of n positions from `at`."""
    table = steps.table
    if table.bound is not None and table.bound < WARM_UP_POSITIONS:
        raise EngineError(
            f"engine.args.maxModelLen of {table.bound} is below the {WARM_UP_POSITIONS} positions that "
            "compile's warm-up runs its requests through: give it at least that many"
        )
    keys = table.layers[0].keys
    assert keys is not None

    def x(rows: int, n: int) -> torch.Tensor:
        return keys.new_zeros(rows, n, width)

    a, b, c = table.take(), table.take(), table.take()
    # The first prefill 5 long, as long as no other size of its inputs: Dynamo gives equal sizes
    # one symbol, and 4, the rows of Qwen3-Omni's position ids, had it compile a graph for
    # prompts of exactly 4 positions (then a general one for the next prefill).
    steps.prefill(a, None, positions(0, 5), x(1, 5))
    steps.step([a], positions(5, 1), x(1, 1))
    steps.prefill(b, None, positions(0, 3), x(1, 3))
    steps.step([a, b], torch.cat([positions(6, 1), positions(3, 1)], dim=-2), x(2, 1))
    steps.prefill(c, table.kept(a), positions(7, 2), x(1, 2))
    for one in (b, c):  # a step alone at a slot past the first: its view's offset a variable
        steps.step([one], positions(9, 1), x(1, 1))
    if together:
        steps.prefill_together([a, b], [positions(0, 5), positions(0, 3)], [x(1, 5), x(1, 3)], 8)
    for slot in (a, b, c):
        table.give_back(slot)
