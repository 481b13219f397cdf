"""Qwen3-Omni's talker, with its code predictor (see the package's docstring): its requests,
their thinker windows and kept conversations; its forwards: talker_steps.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import torch

from omni_pipeline.payloads import Codes, ThinkerStep
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.prompt_cache import Sequence
from omni_stage.engines.slot_cache import warm_up
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from omni_stage.models.qwen3_omni.talker_prompt import TalkerIds
from omni_stage.models.qwen3_omni.talker_steps import Speaking, TalkerPrefill, TalkerStep, TalkerSteps
from omni_stage.models.qwen_omni.parts import (
    TALKER_MAX_CODES,
    SeenCodes,
    code_mask,
    compiler,
    compiles,
)
from omni_stage.models.qwen_omni.prompt import LAYOUT_KEYS
from omni_stage.models.qwen_omni.slots import SlotPart
from omni_stage.segments import EngineOutput

DEFAULT_VOICE: Final = "Ethan"
SUPPRESSED_TOP: Final = 1024
"""The reference suppresses the top 1024 ids of the talker's vocabulary (its control codes),
all but the codec eos."""
TALKER_TEXT_TYPE: Final = "qwen3_omni_moe_talker_text"


class Qwen3Talker(SlotPart):
    """Speaks the thinker's reply from the prompt's user turns. With a `prompt_cache_key` it keeps
    those turns' positions: the next turn's talker prompt begins with them, fed the same rows
    (from the thinker's kept ones), so its prefill computes the rest only (prompt_cache.py)."""

    part = "talker"
    config_class = "Qwen3OmniMoeConfig"
    model_name = "Qwen3-Omni"
    request_keys = params("voice", "prompt_cache_key")
    needs_last_call = True  # past the reply it speaks on the TTS eos, then its pad
    weights = ("model", "text_embeds")

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.text_embeds: torch.Tensor | None = None
        # Concurrent requests' steps run together: the code predictor's residuals of their last
        # codes as one batch, their next talker steps as another; their prompts' prefills too,
        # with `prefillBatchTokens` (a conversation's kept sequence resumed: alone).
        self.steps = TalkerSteps(self)
        self.batcher = StepBatcher(self.steps.run, self._compute, self.max_batch)
        self.prefills = StepBatcher(self.steps.prefills, self._compute, self.max_batch)
        self.prompt_caches = self._kept_conversations()
        self.compiled = compiler(stage, graphs=False)
        self.frames: StaticFrames | None = None
        """The code predictor's frames at fixed shapes (code_predictor.py), replayed as CUDA graphs
        with `cudaGraphs`; None while the weights are away (asleep)."""

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

        return Qwen3OmniMoeTalkerForConditionalGeneration, self.config.talker_config

    def _load(self) -> None:
        register_talker_moe_conversion()
        super()._load()
        c, t = self.config, self.config.talker_config
        # The talker's M-RoPE positions count an audio's tokens with the audio encoder's window,
        # read from `config.audio_config`, which the talker's config does not carry (transformers
        # 5.19: its own generate fails on audio input for that): the thinker's is the one meant.
        self.model.config.audio_config = c.thinker_config.audio_config
        self.speaker_codes = {name.capitalize(): int(code) for name, code in (t.speaker_id or {}).items()}
        self.voices = tuple(sorted(self.speaker_codes, key=lambda v: v != DEFAULT_VOICE))
        # The TTS tokens are rows of the thinker's input embedding table: only that tensor is read.
        self.text_embeds = self._thinker_embeddings()
        self.ids = TalkerIds.of(c)
        self.codec_eos = t.codec_eos_token_id
        self.groups = int(t.num_code_groups)
        vocab = int(t.text_config.vocab_size)
        suppressed = (i for i in range(vocab - SUPPRESSED_TOP, vocab) if i != self.codec_eos)
        self.never = code_mask(vocab, suppressed, self.device)
        self.seen_codes = SeenCodes(vocab, self.device)
        # The decoder layers of the talker and of its code predictor (`compile`).
        self.model.model = self.compiled(self.model.model)
        self.model.code_predictor.model = self.compiled(self.model.code_predictor.model)
        self._build_frames()
        width = int(t.text_config.hidden_size)
        # Its steps run its decoder alone, the codec head after: what a step outputs is one
        # tensor (a captured step's outputs are copied out each replay: the whole talker's
        # would be every layer's hidden states).
        self._build_slots(t.text_config, self.model.model, width, 4)
        if compiles(self.stage):
            self._warm_up()

    def _build_frames(self) -> None:
        """At start and at each wake (a sleep moves the weights the graphs read)."""
        graphs = bool(self.args.get("cudaGraphs", False))
        self.frames = StaticFrames.built(self.model, self.groups, self.max_batch, graphs, self.stage.name)

    def _release_weights(self, level: int) -> None:
        self.frames = None  # (its caches and graphs go with the weights)
        super()._release_weights(level)

    def _restore_weights(self) -> None:
        super()._restore_weights()
        self._build_frames()

    @torch.inference_mode()  # as requests run them: a compile is guarded on the mode
    def _warm_up(self) -> None:
        """Both models, compiled, run in every form requests run them, so that they compile
        now, at start: the talker's prefill and steps (slot_cache.warm_up), and the code
        predictor's frame at each batch bucket."""
        width = self.model.config.text_config.hidden_size

        def span(at: int, n: int) -> torch.Tensor:
            return (
                torch.arange(at, at + n, device=self.device, dtype=torch.float)
                .view(1, 1, -1)
                .expand(4, 1, -1)
            )

        assert self.frames is not None
        self.frames.run_each_bucket()
        assert self.stepper is not None
        warm_up(self.stepper, width, span, together=self.prefill_tokens > 0)

    def speaker(self, sampling: Sampling) -> dict[str, Any]:
        return {"code": self.speaker_codes[self.voice(sampling)]}

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.kept(Speaking)
        self._take(st, call.inputs)
        budget = call.sampling.max_tokens or TALKER_MAX_CODES
        with self._keeping_if_cut(st):  # a barge-in: what it made is kept
            if st.slot is None and not st.done:
                if st.prompt_ids is None or not st.reply:
                    return  # the prefill needs the first reply token's embedding, which comes with the second
                kept = None
                if (key := call.sampling.prompt_cache_key) is not None and self.prompt_caches.capacity:
                    st.key = str(key)
                    kept = await self.prompt_caches.take(st.key)  # on the loop, as every use of the caches
                speaker = self.speaker(call.sampling)["code"]
                if kept is None and self.prefill_tokens:
                    drawn = await self.prefills.submit("prefill", TalkerPrefill(st, speaker))
                    st.code0, st.last_hidden = drawn.code0, drawn.hidden
                else:
                    st.code0, st.last_hidden = await self._run(self.steps.prefill, st, speaker, kept)
            while not st.done:
                k = st.step + 1  # the next step: it draws code k - 1's residuals, then code k
                if st.code0 == self.codec_eos or k >= budget or st.full:
                    st.done = True  # eos has no residuals; nor does the last code a budget (or slot) allows
                    self._keep(st)  # complete: kept for the conversation's next turn
                    self._give_back(st)
                    return
                if st.residuals is None:
                    st.residuals = (await self.batcher.submit("residuals", TalkerStep(st))).residuals
                    yield EngineOutput(units=1, data=Codes(codes=torch.tensor([[st.code0, *st.residuals]])))
                trailing = self._trailing(st, k - 1, call.is_last)
                if trailing is None:
                    return  # waits for the thinker's next window
                drawn = await self.batcher.submit("decode", TalkerStep(st, trailing))
                st.code0, st.last_hidden = drawn.code0, drawn.hidden
                st.step = k
                st.residuals = None

    def _keep(self, st: Speaking) -> None:
        """The user turns' positions of the sequence, kept for the conversation's next turn."""
        if st.key is None or st.kept or st.slot is None or st.user_rows is None or self.prompt_caches is None:
            return
        st.kept = True
        self.prompt_caches.keep(st.key, Sequence.left([], self._held(st), [], {"fed": st.user_rows}))

    def _take(self, st: Speaking, inputs: dict[str, ThinkerStep]) -> None:
        """Gather this window's thinker outputs: the prompt once, and one embedding per token."""
        for p in inputs.values():
            if "prompt_ids" in p and p["prompt_ids"].shape[0] and st.prompt_ids is None:
                st.prompt_ids, st.prompt_embeds = p["prompt_ids"][0], p["prompt_embeds"][0]
                st.prompt_hidden = p["prompt_hidden"][0]
                st.layout = {k: p[f"prompt_{k}"][0] for k in LAYOUT_KEYS if f"prompt_{k}" in p}
            if "reply_embeds" in p:
                st.reply.extend(e.to(self.device, self.dtype) for e in p["reply_embeds"])

    def _text(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.model.text_projection(embeds)

    def tts_row(self, name: str) -> torch.Tensor:
        """A TTS token's row (`tts_pad`, `tts_bos`, `tts_eos`: TalkerIds), projected as the
        talker reads text."""
        assert self.text_embeds is not None
        return self._text(self.text_embeds[getattr(self.ids, name)][None])[0]

    def _trailing(self, st: Speaking, j: int, ended: bool) -> torch.Tensor | None:
        """What step j + 1 is fed beside the codes: reply token j + 1's projected embedding (the
        reference never has the last token's), then the TTS eos, then its pad; None: not yet."""
        reply = st.reply
        if j + 1 < len(reply):
            return self._text(reply[j + 1][None])[0]
        if not ended:
            return None
        return self.tts_row("tts_eos" if j + 1 == len(reply) else "tts_pad")


def register_talker_moe_conversion() -> None:
    """Checkpoints store each expert's weights apart; transformers fuses them on load by the
    model's type, and has the conversion for the thinker's MoE text model and the whole
    model's, but none for the talker's text model, which it only loads inside the whole
    model: loaded alone, its experts would stay uninitialised. Register the same conversion
    (transformers' public API for it)."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    if get_checkpoint_conversion_mapping(TALKER_TEXT_TYPE) is None:
        register_checkpoint_conversion_mapping(
            TALKER_TEXT_TYPE, get_checkpoint_conversion_mapping("qwen2_moe")
        )
