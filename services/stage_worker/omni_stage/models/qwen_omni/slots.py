"""A part whose requests each hold a slot of their replica's KV cache (engines/slot_cache.py):
the talkers always, a thinker with `fixedSteps` (`cudaGraphs`). A slot is taken at the
prefill, on the compute thread, and given back at the request's end however it ends: complete,
on the event loop; failed, aborted or cut, once the compute thread has ended the step in
progress (after a cut request's kept sequence was copied out of it).

`maxModelLen` bounds a request's positions (prompt and reply) and sizes the table at load: it
is allocated once and never grows in positions, so that nothing is allocated, nor captured as
CUDA graphs, while requests are served (4096 by default at fixed shapes, `fixedSteps` or
`cudaGraphs`; without it a talker's table starts at 512 positions and doubles as requests need).
A talker's speech ends where its slot is full, as at its `max_tokens`."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import CallState, EngineError
from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.engines.kv_batch import prefill_budget
from omni_stage.engines.slot_cache import FIRST_POSITIONS, SlotCache, SlotSteps
from omni_stage.models.qwen_omni.parts import Part

LOG = logging.getLogger(__name__)

SLOT_POSITIONS: Final = 4096
"""`maxModelLen` by default at fixed shapes (`fixedSteps`): a slot's positions, allocated at load."""


@dataclass(slots=True, kw_only=True)
class HoldsSlot:
    """A request's state: the slot it holds, and the table it holds it in (a sleep's
    wake builds a new table)."""

    slot: int | None = None
    table: SlotCache | None = None

    @property
    def full(self) -> bool:
        """Whether its slot holds every position it may: it takes no further step."""
        return self.slot is not None and self.table is not None and self.table.full(self.slot)


class SlotPart(Part):
    """A part whose requests step on one slot table (`slots`), built at each load by
    `_build_slots`, by `stepper`: the table's own steps, or with `fixedSteps` (on with
    `cudaGraphs`, which captures them on CUDA) at fixed shapes (engines/fixed_steps.py; on a
    CPU only slower, and there to check them against the table's own). A part that builds no
    table (a thinker without `fixedSteps`) holds no slots."""

    slots: SlotCache | None = None
    stepper: SlotSteps | None = None
    _table_of: Any = None
    steps_ran: Counter[str]

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        if self.args.get("cudaGraphs", False) and self.device.type != "cuda":
            raise EngineError(f"stage '{stage.name}': engine.args.cudaGraphs needs device: cuda")
        asked = self.args.get("maxModelLen", SLOT_POSITIONS if self.fixed_steps else None)
        if asked is not None and (type(asked) is not int or asked <= 0):
            raise EngineError(
                f"stage '{stage.name}': engine.args.maxModelLen must be a whole number above 0, got {asked!r}"
            )
        self.max_model_len: int | None = asked
        """A request's positions at most (None: the model's own); the table's, allocated at load."""
        self.prefill_tokens = prefill_budget(self.args, self.device, stage.name)
        """`prefillBatchTokens` (kv_batch.prefill_budget): the prompts that queue together,
        prefilled together."""
        self.steps_ran = Counter()

    @property
    def fixed_steps(self) -> bool:
        """Whether its decode steps run at fixed shapes (`fixedSteps`, by default `cudaGraphs`)."""
        return bool(self.args.get("fixedSteps", self.args.get("cudaGraphs", False)))

    def _build_slots(
        self,
        decoder: Any,
        model: Any,
        width: int,
        position_rows: int,
        positions: int | None = None,
        **inputs: Any,
    ) -> None:
        """(At each load and wake.) The table for a decoder of transformers' config `decoder`
        (`positions` a slot, by default `maxModelLen`'s; without either, a table that grows),
        and the steps of `model` on it (fed `inputs_embeds` of `width`, position ids of
        `position_rows` M-RoPE rows, and `inputs`)."""
        self._table_of = (decoder, model, width, position_rows, positions, inputs)
        bound = positions or self.max_model_len
        # A slot for each request in flight: a step's rows are its requests' slots, so that its
        # fixed shapes hold them whatever its batch size (`maxBatch` may be smaller).
        slots = max(self.max_batch, self.stage.max_inflight)
        self.slots = table = SlotCache.of(
            decoder, slots, self.dtype, self.device, bound or FIRST_POSITIONS, grows=bound is None
        )
        LOG.info(
            "stage %s: a slot table of %d slots x %d positions%s, %.1f MiB on %s",
            self.stage.name,
            table.capacity[0],
            table.positions,
            "" if bound is None else " (maxModelLen)",
            table.nbytes / 2**20,
            self.device,
        )
        graphs = bool(self.args.get("cudaGraphs", False))
        if self.fixed_steps:
            self.stepper = FixedSteps(
                table, model, slots, width, position_rows, graphs, ran=self.steps_ran, **inputs
            )
        else:
            self.stepper = SlotSteps(table, model, self.steps_ran, **inputs)

    def slot_of(self, st: HoldsSlot) -> int:
        """The request's slot, taken on its first use (its prefill; compute thread)."""
        if st.slot is None:
            assert self.slots is not None
            st.slot, st.table = self.slots.take(), self.slots
        return st.slot

    def _give_back(self, st: HoldsSlot) -> None:
        """The request's slot, given back now: no step of it may be in progress."""
        slot, table, st.slot, st.table = st.slot, st.table, None, None
        if slot is not None and table is not None:
            table.give_back(slot)

    def request_ended(self, state: CallState) -> None:
        st = state.engine
        if (
            isinstance(st, HoldsSlot) and self._table_of is not None
        ):  # read after the compute thread's work: a prefill may be taking one
            self._after_compute(lambda: self._give_back(st))

    def slot_steps(self) -> Counter[str] | None:
        return None if self._table_of is None else self.steps_ran

    def active_requests(self) -> int | None:
        """Slots held: a request's until its end (the leak gauge's); None without a table."""
        if self._table_of is None:
            return None
        return 0 if self.slots is None else self.slots.taken

    def _release_weights(self, level: int) -> None:
        self.slots = self.stepper = None  # (its tensors go with the weights; a wake builds the table again)
        super()._release_weights(level)

    def _restore_weights(self) -> None:
        super()._restore_weights()
        if self._table_of is not None:
            decoder, model, width, position_rows, positions, inputs = self._table_of  # (the same modules)
            self._build_slots(decoder, model, width, position_rows, positions, **inputs)

    def _held(self, st: HoldsSlot) -> Any:
        """The request's positions copied out as its own cache (a conversation's kept sequence)."""
        assert st.slot is not None and st.table is not None
        return st.table.kept(st.slot)
