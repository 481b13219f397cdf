"""Qwen3-TTS as two stages from one checkpoint directory: talker -> code2wav.

- talker (the source stage): the client's text (`/v1/audio/speech`'s `input`) in the
  reference's prompt, with the voice (a named speaker, `voice`), the `language` (Auto, or one the
  checkpoint lists) and a style instruction (`instructions`); greedy frames of 16 codes as
  steps.py draws them, each sent on as soon as it is drawn. Concurrent requests' code predictor
  frames, and their next talker steps, run as one batch each.
- code2wav: the speech tokenizer's decoder as a stream (qwen3_omni/code2wav.py): each code decoded once,
  from what the codes before it left, 1920 samples a code at 24 kHz, the whole decode's; its
  first audio after one code (a first piece, sized by the load), then `chunkCodes` (25) at a time.

The checkpoint's `tts_model_type` says which voices it speaks in: CustomVoice (a named speaker,
steered by `instructions`), VoiceDesign (no speaker: the voice is what `instructions` describes,
required) or Base (a voice cloned from `ref_audio`, a clip: from the speaker's x-vector alone
with `x_vector_only_mode`, or in context with the clip's transcript, `ref_text`: the talker then
sends the clip's codes first, as code2wav's context, which it decodes and never voices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_pipeline.payloads import Codes
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import StageSpec
from omni_pipeline.voices import VoicePrint
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest
from omni_stage.engines.batching import StepBatcher
from omni_stage.models.qwen3_omni.code2wav import Qwen3Code2Wav
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from omni_stage.models.qwen3_tts.cloning import ClonedVoice, VoiceCloner
from omni_stage.models.qwen3_tts.loading import load_cloner, load_decoder, load_talker, read_config
from omni_stage.models.qwen3_tts.prompt import TTSIds, TTSPrompt, tts_prompt
from omni_stage.models.qwen3_tts.steps import Speaking, TTSSteps
from omni_stage.models.qwen_omni.parts import TALKER_MAX_CODES
from omni_stage.models.qwen_omni.slots import SlotPart
from omni_stage.segments import EngineOutput

TASKS: Final = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
"""`tts_model_type` -> the `task_type` it serves, in vLLM-Omni's words."""
DEFAULT_VOICE: Final = "vivian"
Voice = str | ClonedVoice | None
"""A request's voice: a named speaker, one cloned, or none (described, or the model's own)."""
MODEL_NAME: Final = "Qwen3-TTS"


def _checked_path(stage: StageSpec) -> Path:
    path = Path(str(stage.engine.model))
    if not path.is_dir():
        raise EngineError(f"stage '{stage.name}': model directory {str(path)!r} not found")
    return path


@dataclass(slots=True)
class _Step:
    """One request's piece of a batched step: its last frame fed back (none on its first), then
    its next frame drawn, unless its codes end there (`budget`: its codes 0 at most)."""

    st: Speaking
    budget: int
    fed: list[int] | None = None


class Qwen3TTSTalker(SlotPart):
    """Text to codes, one frame at a time (module docstring)."""

    part = "talker"
    model_name = MODEL_NAME
    honours = params(
        "language", "instructions", "task_type", "non_streaming_mode", "ref_text", "x_vector_only_mode"
    )
    weights = ("model", "cloner")

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.steps: TTSSteps | None = None
        self.cloner: VoiceCloner | None = None
        self.batcher = StepBatcher(self._steps, self._compute, self.max_batch)
        self.prefills = StepBatcher(self._prefills, self._compute, self.max_batch)
        """Prompts that queue together, prefilled together (`prefillBatchTokens`)."""

    def _load(self) -> None:
        from transformers import Qwen2TokenizerFast

        self._set_threads()
        path = _checked_path(self.stage)
        try:
            self.settings = read_config(path)
        except ValueError as exc:
            raise EngineError(f"stage '{self.stage.name}': {exc}") from None
        talker_config = self.settings["talker_config"]
        self.task = TASKS.get(str(self.settings.get("tts_model_type")), "")
        if not self.task:
            raise EngineError(
                f"stage '{self.stage.name}': {path} has tts_model_type "
                f"{self.settings.get('tts_model_type')!r}, not one of {', '.join(TASKS)}"
            )
        dummy = self.load_format == "dummy"
        self.model = load_talker(path, self.device, self.dtype, dummy)
        if self.task == "Base":
            self.cloner = load_cloner(path, self.device, self.dtype, dummy)
            self.accepts = frozenset({"text", "ref_audio"})  # announced: gateways refuse clips elsewhere
        # Qwen2's, by name: AutoTokenizer would read config.json as a model's (transformers has no
        # qwen3_tts) and warn at every start that it does not know it.
        self.tokenizer = Qwen2TokenizerFast.from_pretrained(path)
        self.ids = TTSIds.of(self.settings)
        self.voices = tuple(sorted(self.ids.speakers, key=lambda v: (v != DEFAULT_VOICE, v)))
        named = (lang.capitalize() for lang in self.ids.languages if "dialect" not in lang)
        self.languages = ("Auto", *named)  # the heartbeat's: a gateway refuses others first
        self.instructs = self.settings.get("tts_model_size") != "0b6"  # the reference drops them on 0.6B
        self.context = int(talker_config.get("max_position_embeddings", 32768))
        if self.max_model_len is not None:  # (/tokenize's max_model_len)
            self.context = min(self.context, self.max_model_len)
        self._build_slots(self.model.config, self.model.model, self.model.config.hidden_size, 0)
        self._build_steps()

    def _build_steps(self) -> None:
        """At start and at each wake (the code predictor's frames are built on the weights)."""
        groups = int(self.settings["talker_config"]["num_code_groups"])
        graphs = bool(self.args.get("cudaGraphs", False))
        frames = StaticFrames.built(self.model, groups, self.max_batch, graphs, self.stage.name)
        assert self.stepper is not None
        self.steps = TTSSteps(self.model, self.ids, frames, self.stepper)

    def _release_weights(self, level: int) -> None:
        self.steps = None  # (its frames' caches go with the weights)
        super()._release_weights(level)

    def _restore_weights(self) -> None:
        super()._restore_weights()
        self._build_steps()

    def prompt_tokenizer(self) -> tuple[Any, int] | None:
        return self.tokenizer, self.context

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request") or {}
        prompt, tokens, voice = await self._run(self._prompt, request, call.sampling)
        call.state.prompt_tokens = tokens
        if isinstance(voice, ClonedVoice) and voice.codes is not None:  # code2wav's context
            n = int(voice.codes.shape[0])
            yield EngineOutput(units=n, data=Codes(codes=voice.codes, context=n))
        st = Speaking(prompt)
        call.state.engine = st  # its slot given back at the request's end (`request_ended`)
        budget = call.sampling.max_tokens or TALKER_MAX_CODES
        assert self.steps is not None
        if self.prefill_tokens:
            await self.prefills.submit("prefill", st)
        else:
            await self._run(self.steps.prefill, st)
        # Each step is queued as soon as the last is answered, before its frame goes out: the
        # requests answered together are then waiting together for the next batch.
        step = self.batcher.submit("frame", _Step(st, budget))
        try:
            while (frame := await step) is not None:
                step = self.batcher.submit("frame", _Step(st, budget, frame))
                yield EngineOutput(units=1, data=Codes(codes=torch.tensor([frame])))
        finally:
            step.cancel()  # (cut short: the step queued is dropped)
        self._give_back(st)
        call.state.finish_reason = "stop" if st.code0 == self.ids.codec_eos else "length"

    def _prompt(self, request: dict[str, Any], sampling: Sampling) -> tuple[TTSPrompt, int, Voice]:
        """The request's prompt, its prompt's length in tokens, and its voice; its fields checked
        first (a 400 naming the one this model cannot do)."""
        self._check(request, sampling)
        language = sampling.language or "Auto"

        def tokens(turn: str) -> torch.Tensor:
            return self.tokenizer(turn, return_tensors="pt").input_ids

        turn = tokens(f"<|im_start|>assistant\n{request['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        instruct = None
        if sampling.instructions:
            instruct = tokens(f"<|im_start|>user\n{sampling.instructions}<|im_end|>\n")
        with torch.inference_mode():
            voice: Voice = None
            if self.cloner is not None:
                voice = self._cloned(request, sampling)
                if voice.codes is not None:
                    transcript = tokens(f"<|im_start|>assistant\n{sampling.ref_text}<|im_end|>\n")
                    voice = dataclasses.replace(voice, text_ids=transcript)
            elif self.voices:
                voice = self.voice(sampling)
            default = self.task != "Base"  # the reference's: the whole text, but for a clone
            whole = default if sampling.non_streaming_mode is None else sampling.non_streaming_mode
            prompt = tts_prompt(self.model, self.ids, turn, language, voice, instruct, whole)
        return prompt, int(turn.shape[1]) + (0 if instruct is None else int(instruct.shape[1])), voice

    def _cloned(self, request: dict[str, Any], sampling: Sampling) -> ClonedVoice:
        """The request's voice: its clip's, or the print an uploaded voice keeps."""
        assert self.cloner is not None
        media = request.get("media") or {}
        if (kept := request.get("voice_print")) is not None:
            codes = media[kept["codes"]] if kept.get("codes") else None
            return ClonedVoice(media[kept["x_vector"]], codes)
        clip = request["ref_audio"]
        in_context = not sampling.x_vector_only_mode
        return self.cloner.clone(media[clip["media"]], int(clip["sample_rate"]), in_context)

    async def clone_voice(self, samples: torch.Tensor, rate: int, ref_text: str | None) -> VoicePrint:
        if self.cloner is None:
            raise InvalidRequest(f"this model does {self.task}; a Base model clones voices")
        voice = await self._run(self.cloner.clone, samples, rate, bool(ref_text))
        return VoicePrint.of(voice.x_vector, voice.codes, ref_text)

    def _check(self, request: dict[str, Any], sampling: Sampling) -> None:
        """A 400 naming the first field this model cannot do as asked."""
        if not str(request.get("prompt") or ""):
            raise InvalidRequest(f"{MODEL_NAME} speaks text: the request has none")
        if sampling.speed is not None:  # a speech request's, for a vocoder: this decoder has none
            raise InvalidRequest(f"speed: {MODEL_NAME} speaks at the pace it draws its codes; leave it out")
        task = sampling.task_type
        if task is not None and task != self.task:
            raise InvalidRequest(f"task_type: this model does {self.task}, not {task}")
        language = sampling.language or "Auto"
        if language.lower() not in (lang.lower() for lang in self.languages):
            raise InvalidRequest(
                f"language: '{language}' is not one of this model's languages: {', '.join(self.languages)}"
            )
        if sampling.voice is not None and not self.voices:
            raise InvalidRequest(f"voice: a {self.task} model's audio takes no named voice; leave it out")
        clip = request.get("ref_audio") or request.get("voice_print")
        cloning = {"ref_audio": clip, "ref_text": sampling.ref_text}
        cloning["x_vector_only_mode"] = sampling.x_vector_only_mode
        if self.task != "Base":
            if asked := [name for name, value in cloning.items() if value is not None]:
                raise InvalidRequest(f"{asked[0]}: this model does {self.task}; a Base model clones voices")
        elif clip is None:
            raise InvalidRequest("ref_audio: a Base model speaks in a voice cloned from a clip: send one")
        elif "media" in clip and not sampling.x_vector_only_mode and not sampling.ref_text:
            raise InvalidRequest(
                "ref_text: cloning in context needs the clip's transcript (or x_vector_only_mode: true, "
                "the speaker's x-vector alone)"
            )
        elif sampling.x_vector_only_mode and sampling.ref_text:
            raise InvalidRequest("ref_text: x_vector_only_mode clones from the x-vector alone; leave it out")
        if sampling.instructions:
            if self.task == "Base":
                raise InvalidRequest("instructions: a Base model speaks as its clip does; leave them out")
            if not self.instructs:
                raise InvalidRequest("instructions: this model (Qwen3-TTS 0.6B) follows none; leave it out")
        elif self.task == "VoiceDesign":
            raise InvalidRequest(
                "instructions: a VoiceDesign model speaks in the voice they describe: describe one"
            )

    def _prefills(self, sts: list[Speaking]) -> list[None]:
        """The prompts that queued together, prefilled (TTSSteps.prefill_together), each
        request's first code drawn."""
        assert self.steps is not None
        self.steps.prefill_together(sts, self.prefill_tokens)
        return [None] * len(sts)

    def _steps(self, steps: list[_Step]) -> list[list[int] | None]:
        """One batched step of every request that asks: the talker's next step for those with a
        frame to feed back, then the code predictor's frame for those whose codes go on (None:
        they ended). One call a frame, so concurrent requests stay in step, batched together."""
        assert self.steps is not None
        fed = [s for s in steps if s.fed is not None]
        if fed:
            self.steps.decode([s.st for s in fed], [s.fed for s in fed])  # type: ignore[misc]
        going = [s for s in steps if not self.steps.finished(s.st, s.budget)]
        drawn = iter(self.steps.residuals([s.st for s in going]) if going else [])
        return [None if self.steps.finished(s.st, s.budget) else next(drawn) for s in steps]


class Qwen3TTSCode2Wav(Qwen3Code2Wav):
    """The speech tokenizer's decoder as a stream (qwen3_omni/code2wav.py): its transposed
    convolutions are cut on the right only, so a piece of n codes gives all n x 1920 samples."""

    model_name = MODEL_NAME

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)

    def _load(self) -> None:
        self._set_threads()
        self.model = load_decoder(_checked_path(self.stage), self.device, self.load_format == "dummy")
        self.upsample = int(self.model.total_upsample)
