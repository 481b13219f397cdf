"""Qwen3-Omni's talker's forwards on its compute thread (the part's step batchers run
`TalkerSteps.run` and `TalkerSteps.prefills`): a prompt's prefill, alone (a conversation's
next turn on its kept sequence) or with the prompts queued beside it (`prefillBatchTokens`),
the code predictor's residual codes of each request's last code, and the talker's next step
on the slot table; each batch's codes picked at once. A request's state (`Speaking`) is what
they step on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omni_stage.engines.prompt_cache import PromptCaches, Sequence, same_rows
from omni_stage.engines.slot_cache import SlotCache, SlotSteps
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames, frames_embedding
from omni_stage.models.qwen3_omni.talker_prompt import TalkerIds, TalkerPrompt, talker_prompt
from omni_stage.models.qwen_omni.parts import SeenCodes
from omni_stage.models.qwen_omni.slots import HoldsSlot


class Talker(Protocol):
    """What the forwards read of their talker (speech.py's part), as its load left it."""

    device: torch.device
    dtype: torch.dtype
    model: Any
    ids: TalkerIds
    slots: SlotCache | None
    stepper: SlotSteps | None
    frames: StaticFrames | None
    seen_codes: SeenCodes
    never: torch.Tensor
    prompt_caches: PromptCaches
    prefill_tokens: int

    def slot_of(self, st: HoldsSlot) -> int: ...

    def tts_row(self, name: str) -> torch.Tensor: ...


@dataclass(slots=True)
class Speaking(HoldsSlot):
    """A talker's request: the thinker's prompt (ids, embeddings, states, media layout), one
    reply embedding per token so far, its cache's slot and M-RoPE offset, and the step: code 0
    of step `step` with the hidden state that drew it, and its residuals once drawn."""

    reply: list[torch.Tensor] = field(default_factory=list)
    prompt_ids: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    layout: dict[str, torch.Tensor] = field(default_factory=dict)
    rope_delta: int = 0
    step: int = 0
    code0: int = 0
    last_hidden: torch.Tensor | None = None
    residuals: list[int] | None = None
    done: bool = False
    key: str | None = None
    """The conversation's `prompt_cache_key`: the user turns' positions are kept under it."""
    user_rows: torch.Tensor | None = None
    """With a key, the user turns' input rows: what the conversation's next turn begins with."""
    kept: bool = False


@dataclass(frozen=True, slots=True)
class TalkerPrefill:
    """A request's talker prompt to prefill (with those queued beside it, `prefillBatchTokens`):
    its state and its voice's speaker code."""

    st: Speaking
    speaker: int


@dataclass(slots=True)
class TalkerStep:
    """One request's piece of a batched talker step: its state and, for a decode step, the
    text it is fed (none: its last code's residuals are drawn); what the step drew."""

    st: Speaking
    trailing: torch.Tensor | None = None
    residuals: list[int] = field(default_factory=list)
    code0: int = 0
    hidden: torch.Tensor | None = None


class TalkerSteps:
    """The forwards of a Qwen3-Omni talker `part`, reading its model, slot table and frames as
    they are at each call (each load, a wake's included, builds them again)."""

    def __init__(self, part: Talker) -> None:
        self.part = part

    def _talker_prompt(self, st: Speaking, speaker: int) -> TalkerPrompt:
        """The request's talker prompt (talker_prompt.py), its M-RoPE offset and (with a key)
        its user turns' rows set on it."""
        assert st.prompt_ids is not None and st.prompt_embeds is not None and st.prompt_hidden is not None
        thinker = (
            st.prompt_ids.to(self.part.device),
            st.prompt_embeds.to(self.part.device, self.part.dtype),
            st.prompt_hidden.to(self.part.device, self.part.dtype),
        )
        tts = {name: self.part.tts_row(name) for name in ("tts_pad", "tts_bos")}
        p = talker_prompt(self.part.model, self.part.ids, tts, thinker, st.reply[0], speaker, st.layout)
        st.rope_delta = p.rope_delta
        if st.key is not None:
            st.user_rows = p.user_rows
        return p

    @torch.inference_mode()
    def prefill(self, st: Speaking, speaker: int, seq: Sequence | None) -> tuple[int, torch.Tensor]:
        """The talker's prompt; on `seq`, the conversation's kept sequence, as far as these user
        turns' rows are the ones it was fed."""
        p = self._talker_prompt(st, speaker)
        inputs, positions = p.inputs, p.positions
        past = None
        if seq is not None and (n := same_rows(seq.rows["fed"], p.user_rows)):
            seq.cut(n)
            past, inputs, positions = seq.past, inputs[:, n:], positions[..., n:]
            self.part.prompt_caches.reused_tokens += n
        assert self.part.stepper is not None
        slot = self.part.slot_of(st)
        self.part.seen_codes.start(slot)
        out = self.part.stepper.prefill(slot, past, positions, inputs)
        last = out.last_hidden_state[:, -1:]  # (the prompt's other positions' logits: never read)
        [code] = self._picks([st], self.part.model.codec_head(last)[:, -1])
        return code, last

    @torch.inference_mode()
    def prefills(self, prefills: list[TalkerPrefill]) -> list[TalkerStep]:
        """Prompts that queued together, on new caches, in forwards of prompts of about one
        length (`prefillBatchTokens` positions at most; SlotSteps.prefill_together), their first
        codes picked together; one alone as `prefill`."""
        if len(prefills) == 1:
            [p] = prefills
            code, hidden = self.prefill(p.st, p.speaker, None)
            return [TalkerStep(p.st, code0=code, hidden=hidden)]
        sts = [p.st for p in prefills]
        prompts = [self._talker_prompt(p.st, p.speaker) for p in prefills]
        slots = [self.part.slot_of(st) for st in sts]
        for slot in slots:
            self.part.seen_codes.start(slot)
        assert self.part.stepper is not None
        ends = self.part.stepper.prefill_together(
            slots, [p.positions for p in prompts], [p.inputs for p in prompts], self.part.prefill_tokens
        )
        last = torch.stack([e.output.last_hidden_state[e.row, e.last] for e in ends])[:, None]  # [B, 1, H]
        codes = self._picks(sts, self.part.model.codec_head(last)[:, -1])
        return [
            TalkerStep(st, code0=c, hidden=last[i : i + 1])
            for i, (st, c) in enumerate(zip(sts, codes, strict=True))
        ]

    @torch.inference_mode()
    def run(self, steps: list[TalkerStep]) -> list[TalkerStep]:
        """One batch of one kind: every request's residuals, or every request's next code."""
        if steps[0].trailing is None:
            return self._residuals(steps)
        return self._decodes(steps)

    def _residuals(self, steps: list[TalkerStep]) -> list[TalkerStep]:
        """The code predictor's residual codebooks for each request's last code."""
        sts = [s.st for s in steps]
        assert all(st.last_hidden is not None for st in sts)
        hidden = torch.cat([st.last_hidden for st in sts])  # type: ignore[misc]
        assert self.part.frames is not None
        drawn = self.part.frames.residuals(hidden, [st.code0 for st in sts])
        return [TalkerStep(st, residuals=row) for st, row in zip(sts, drawn, strict=True)]

    def _decodes(self, steps: list[TalkerStep]) -> list[TalkerStep]:
        """Each request's next code 0 and the hidden state that drew it: its codes' embeddings
        summed, plus the step's text, at its own position in its own cache."""
        sts = [s.st for s in steps]
        codes = [[st.code0, *st.residuals] for st in sts]  # type: ignore[misc]
        trailing = torch.stack([s.trailing for s in steps])[:, None]  # type: ignore[misc]
        inputs = (
            frames_embedding(self.part.model, torch.tensor(codes, device=self.part.device))[0][:, None]
            + trailing
        )
        slots = [self.part.slot_of(st) for st in sts]
        assert self.part.stepper is not None
        out, rows = self.part.stepper.step(slots, self._step_positions(sts), inputs)
        last = out.last_hidden_state
        drawn = self._picks(sts, self.part.model.codec_head(last)[rows, -1])
        return [
            TalkerStep(st, code0=code, hidden=last[r : r + 1, -1:])
            for st, r, code in zip(sts, rows, drawn, strict=True)
        ]

    def _step_positions(self, sts: list[Speaking]) -> torch.Tensor:
        """[4, B, 1]: each step's text position, and its M-RoPE ones (offset by its prompt's
        media), as one tensor, of floats as the prompt's (talker_prompt._positions)."""
        assert self.part.slots is not None
        text = [self.part.slots.lengths[st.slot] for st in sts]  # type: ignore[index]
        rope = [at + st.rope_delta for at, st in zip(text, sts, strict=True)]
        return torch.tensor([text, rope, rope, rope], device=self.part.device, dtype=torch.float)[..., None]

    def _picks(self, sts: list[Speaking], logits: torch.Tensor) -> list[int]:
        """Each request's code 0 from its row of `logits` [B, vocab]: greedy, with the
        reference's repetition penalty over its codes so far and its suppressed control codes."""
        return self.part.seen_codes.greedy(
            logits.float(), [self.part.slot_of(st) for st in sts], self.part.never
        )
