"""Qwen3-TTS's talker steps, greedy, as the reference's `generate` draws them: the prompt's
prefill; then per frame the code predictor's residual codes (StaticFrames, shared with Qwen3-
Omni's talker) and the talker's next step, fed the frame's codes summed and the next text row.
Several requests' residuals, and their next steps, run as one batch each (the stage batches
what comes together; `speak` runs one request alone, as the reference does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import torch

from omni_stage.engines.slot_cache import SlotSteps
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames, frames_embedding
from omni_stage.models.qwen3_omni.speech import SUPPRESSED_TOP
from omni_stage.models.qwen3_tts.modeling import Talker
from omni_stage.models.qwen3_tts.prompt import TTSIds, TTSPrompt
from omni_stage.models.qwen_omni.parts import SeenCodes, code_mask
from omni_stage.models.qwen_omni.slots import HoldsSlot

MIN_CODES: Final = 2
"""The reference's `min_new_tokens`: the eos is not drawn before two codes."""


@dataclass(slots=True)
class Speaking(HoldsSlot):
    """One request's talker state: its prompt and its cache's slot, code 0 of the frame under
    way with the hidden state that drew it, every code 0 drawn (the repetition penalty's),
    frames fed back."""

    prompt: TTSPrompt
    hidden: torch.Tensor | None = None
    code0: int = 0
    seen: list[int] = field(default_factory=list)
    fed: int = 0

    def text_row(self) -> torch.Tensor:
        """What the next step adds to its frame's codes: the next text row, then the TTS pad."""
        trailing = self.prompt.trailing
        return trailing[:, self.fed : self.fed + 1] if self.fed < trailing.shape[1] else self.prompt.pad


class TTSSteps:
    """The talker's steps on a loaded talker (modeling.Talker), its code predictor frames and
    its steps on its slot table; a request takes its slot at its prefill, and its owner gives
    it back."""

    def __init__(self, talker: Talker, ids: TTSIds, frames: StaticFrames, steps: SlotSteps) -> None:
        self.talker = talker
        self.ids = ids
        self.frames = frames
        self.steps = steps
        self.slots = steps.table
        vocab = talker.config.vocab_size
        device = talker.codec_head.weight.device
        suppressed = [i for i in range(vocab - SUPPRESSED_TOP, vocab) if i != ids.codec_eos]
        # What a row may not draw: the suppressed control codes; and the eos before MIN_CODES codes.
        self.never = torch.stack(
            [code_mask(vocab, suppressed, device), code_mask(vocab, [*suppressed, ids.codec_eos], device)]
        )
        self.seen_codes = SeenCodes(vocab, device)

    def finished(self, st: Speaking, budget: int) -> bool:
        """At the codec's eos, or at the last code 0 `budget` allows (its residuals are never
        drawn: the reference's generate stops there), or its slot allows (a table bounded by
        `maxModelLen`)."""
        return st.code0 == self.ids.codec_eos or len(st.seen) >= budget or st.full

    @torch.inference_mode()
    def prefill(self, st: Speaking) -> None:
        slot = self._slot(st)
        inputs = st.prompt.inputs
        out = self.steps.prefill(slot, None, _positions(inputs), inputs)
        self._draw([st], out.last_hidden_state[:, -1:])

    @torch.inference_mode()
    def prefill_together(self, sts: list[Speaking], budget: int) -> None:
        """Prompts that queued together, in forwards of prompts of about one length (`budget`
        positions at most; SlotSteps.prefill_together), their first codes drawn together; one
        alone as `prefill`."""
        if len(sts) == 1:
            return self.prefill(sts[0])
        slots = [self._slot(st) for st in sts]
        inputs = [st.prompt.inputs for st in sts]
        ends = self.steps.prefill_together(slots, [_positions(x) for x in inputs], inputs, budget)
        self._draw(sts, torch.stack([e.output.last_hidden_state[e.row, e.last] for e in ends])[:, None])

    def _slot(self, st: Speaking) -> int:
        """The request's slot, taken at its first prefill (a batch that failed ran it once
        before), its codes so far none."""
        if st.slot is None:
            st.slot, st.table = self.slots.take(), self.slots
        self.seen_codes.start(st.slot)
        return st.slot

    @torch.inference_mode()
    def residuals(self, sts: list[Speaking]) -> list[list[int]]:
        """Each request's frame: its code 0 and the code predictor's codes after it."""
        hidden = torch.cat([st.hidden for st in sts])  # type: ignore[misc]
        drawn = self.frames.residuals(hidden, [st.code0 for st in sts])
        return [[st.code0, *rest] for st, rest in zip(sts, drawn, strict=True)]

    @torch.inference_mode()
    def decode(self, sts: list[Speaking], frames: list[list[int]]) -> None:
        """Each request's next step, fed its frame and its next text row, drawing its next code 0."""
        text = torch.cat([st.text_row() for st in sts])
        device = text.device
        inputs = frames_embedding(self.talker, torch.tensor(frames, device=device))[0][:, None] + text
        for st in sts:
            st.fed += 1
        slots: list[int] = [st.slot for st in sts]  # type: ignore[misc]
        positions = torch.tensor([[self.slots.lengths[s]] for s in slots], device=inputs.device)
        out, rows = self.steps.step(slots, positions, inputs)
        self._draw(sts, out.last_hidden_state[rows, -1:])

    def speak(self, prompt: TTSPrompt, budget: int) -> list[list[int]]:
        """One request alone, start to end: every frame [16 codes]."""
        st = Speaking(prompt)
        frames = []
        try:
            self.prefill(st)
            while not self.finished(st, budget):
                [codes] = self.residuals([st])
                frames.append(codes)
                self.decode([st], [codes])
        finally:
            if st.slot is not None:
                self.slots.give_back(st.slot)
        return frames

    def _draw(self, sts: list[Speaking], hidden: torch.Tensor) -> None:
        """Each request's code 0 from its row of the step's last hidden states ([B, 1, H]):
        greedy, with the reference's repetition penalty over its codes 0 so far, its control
        codes suppressed, no eos before two codes."""
        early = torch.tensor([int(len(st.seen) < MIN_CODES) for st in sts], device=hidden.device)
        logits = self.talker.codec_head(hidden)[:, -1].float()
        slots: list[int] = [st.slot for st in sts]  # type: ignore[misc]
        codes = self.seen_codes.greedy(logits, slots, self.never[early])
        for row, (st, code) in enumerate(zip(sts, codes, strict=True)):
            st.hidden, st.code0 = hidden[row : row + 1], code
            st.seen.append(code)


def _positions(inputs: torch.Tensor) -> torch.Tensor:
    """[1, n]: a prompt's position ids (its inputs [1, n, H])."""
    return torch.arange(inputs.shape[1], device=inputs.device)[None]
