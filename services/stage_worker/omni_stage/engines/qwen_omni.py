"""Qwen2.5-Omni as three stages from one checkpoint: thinker -> talker -> code2wav.

`engine: {kind: transformers, model: DIR, args: {part: thinker|talker|token2wav}}` on a
checkpoint whose config is `qwen2_5_omni`. Each stage loads only its part, with transformers'
own class and `from_pretrained(DIR, config=<its sub-config>, key_mapping={"^part.": ""})`, and
computes what `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` computes,
split where the model splits (and, with `part: encoder`, its audio and vision encoders in a
stage of their own in front of the thinker: qwen_omni_encoder.py):

- thinker: the chat template, then greedy (or sampled) decoding with a KV cache. Unit `s` is
  generated token `s` with, from the forward that produced it, the input embedding and last
  hidden state of the position it consumed: the prompt's (`prompt_embeds`, `prompt_hidden`,
  [1, P, hidden], in unit 0 only) or token `s - 1`'s. That is all the talker reads.
- talker: prefill on the prompt's hidden+embedding, the voice's text bos and token 0's reply
  state, then one codec code per step, each step fed the next reply state (then the thinker's
  text eos, then its pad) as the model's own forward does. As transformers' `generate` runs it
  (5.x): its attention mask never reaches the talker's forward, so the forward's prefill
  branch does not run: no codec pad/bos embedding on the last two prefill positions, and
  positions count 0, 1, 2, ... (Qwen's original code adds both; with text-only input the
  positions are the same.) We compute what the reference computes; docs/models.md says more.
  Step `k` needs reply state `k`, which the thinker sends with token `k + 1`: on a window
  that ends earlier the talker stops and goes on with the next window, its KV cache kept in
  the request's state. Codes: greedy with the reference's repetition penalty (1.05 over every
  code fed so far) and the codec bos suppressed; it stops at the codec pad or end code.
- token2wav: the DiT (an ODE from noise, 10 Runge-Kutta steps with guidance) and BigVGAN, on
  the whole code sequence or in chunks with context (`chunkCodes`): 24 kHz. The noise comes
  from the request's seed (0 by default) exactly as the reference draws it after
  `torch.manual_seed(seed)`.

The request's voice (`audio.voice`, Chelsie or Ethan here) picks the talker's text bos and the
DiT's speaker conditioning; the thinker refuses an unknown one before it starts (a 400).
Each replica runs its forwards on one compute thread: per-request state (KV cache, rope
offsets) lives in the request, never in the model, and the steps of concurrent requests run
as batches (`StepBatcher`): thinker and talker decode steps with their caches stacked
(`kv_batch.py`), code2wav chunks of one length and voice stacked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import ComputeEngine, EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.kv_batch import decode_together
from omni_stage.engines.prompts import check_context
from omni_stage.engines.qwen_omni_prompt import MediaEmbeds, Prompt, Prompts
from omni_stage.engines.reply import ReplyText, token_logprobs
from omni_stage.engines.sampling import HONOURED, Choice, TokenSampler
from omni_stage.engines.structured import JsonGrammars
from omni_stage.segments import EngineOutput

DEFAULT_VOICE: Final = "Chelsie"
REPETITION_PENALTY: Final = 1.05  # Qwen2_5OmniForConditionalGeneration.generate's talker default
TALKER_MAX_CODES: Final = 4096  # its talker_max_new_tokens
_DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def penalise_repeats(logits: torch.Tensor, seen: Iterable[int]) -> torch.Tensor:
    """The talkers' repetition penalty over the codes `seen`, with transformers' own processor,
    as the references' generate applies it."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([sorted(set(seen))], dtype=torch.long, device=logits.device)
    return RepetitionPenaltyLogitsProcessor(REPETITION_PENALTY)(ids, logits[None])[0]


def thinker_embedding_table(stage: str, path: str) -> torch.Tensor:
    """The thinker's input embedding table, read alone from the checkpoint's safetensors."""
    from safetensors import safe_open

    name = "thinker.model.embed_tokens.weight"
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return sf.get_tensor(name)
    raise EngineError(f"stage '{stage}': {path} has no {name}")


class Part(ComputeEngine):
    """Loading one part of the checkpoint, and the voices."""

    part: str
    weights: tuple[str, ...] = ("model",)
    config_class = "Qwen2_5OmniConfig"
    model_name = "Qwen2.5-Omni"

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.dtype = _DTYPES[self.args.get("dtype", "float32")]
        self.path = str(stage.engine.model)
        self.model: Any = None
        self.config: Any = None
        self.speakers: dict[str, dict[str, Any]] = {}
        """Each voice's conditioning, from the checkpoint's speaker file."""

    async def start(self) -> None:
        await self._run(self._load)

    def _load(self) -> None:
        self._read_config()
        cls, sub = self._part_class()
        self.model = self._from_checkpoint(cls, sub, f"^{self.part}\\.")
        spk = Path(self.path, "spk_dict.pt")
        if spk.exists() and self.part != "thinker":  # a file of the checkpoint, loaded as transformers does
            self.speakers = torch.load(spk, weights_only=True)
            self.voices = tuple(sorted(self.speakers, key=lambda name: name != DEFAULT_VOICE))

    def _read_config(self) -> None:
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()  # the load report lists the other parts' weights
        if threads := self.args.get("threads"):
            torch.set_num_threads(int(threads))
        if not Path(self.path).is_dir():
            raise EngineError(f"stage '{self.stage.name}': model directory {self.path!r} not found")
        try:
            self.config = getattr(transformers, self.config_class).from_pretrained(self.path)
        except (OSError, ValueError) as exc:
            raise EngineError(
                f"stage '{self.stage.name}': {self.path} is not a {self.model_name} checkpoint: {exc}"
            ) from exc

    def _from_checkpoint(self, cls: Any, config: Any, prefix: str) -> Any:
        """Transformers' class `cls` with the checkpoint's weights under `prefix` (a regex)."""
        return (
            cls.from_pretrained(self.path, config=config, key_mapping={prefix: ""}, dtype=self.dtype)
            .to(self.device)
            .eval()
        )

    def _part_class(self) -> tuple[Any, Any]:
        """The transformers class of this part and its sub-config (a part loaded whole)."""
        raise NotImplementedError

    def speaker(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The conditioning of the request's voice."""
        if not self.voices:
            raise EngineError(f"stage '{self.stage.name}': {self.path} has no speaker file (spk_dict.pt)")
        return self.speakers[self.voice(sampling)]


class Thinker(Part):
    """Reads the client's messages, their audio, images and videos included (see `Prompt`)."""

    part = "thinker"
    accepts = frozenset({"text", "image", "audio"})
    honours = HONOURED
    prompts_class = Prompts
    talker_layer = -1
    """The layer whose hidden states the talker reads (-1: the last, normed)."""
    sends_reply_hidden = True
    """Whether the talker reads each reply token's hidden state, or only its embedding."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.tokenizer: Any = None
        self.prompts: Prompts | None = None
        self.eos: set[int] = set()
        self.grammars: JsonGrammars | None = None
        self.batcher = StepBatcher(self._steps, self._compute, self.max_batch)

    @property
    def vocab_size(self) -> int:
        return int(self.config.thinker_config.text_config.vocab_size)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration, self.config.thinker_config

    def _load(self) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        super()._load()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.prompts = self.prompts_class(
            self.path, self.tokenizer, self.config.thinker_config, self.device, self.dtype
        )
        self.accepts = self.prompts.accepts
        eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if "response_format" in self.honours:
            self.grammars = JsonGrammars(self.tokenizer, self.vocab_size, sorted(self.eos))

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request")
        if request is None:
            raise EngineError(f"stage '{self.stage.name}': the thinker reads the client request")
        assert self.prompts is not None
        # An encoder stage's outputs, where one ran on this request's media.
        embeds = next((e for p in call.inputs.values() if (e := MediaEmbeds.from_payload(p))), None)
        prompt = await self._run(self.prompts.build, request, embeds)
        ids = prompt.ids
        st = call.state
        st["prompt_tokens"] = int(ids.shape[1])
        budget = int(call.sampling.get("max_tokens") or 64)
        check_context(
            int(ids.shape[1]), budget, self.config.thinker_config.text_config.max_position_embeddings
        )
        # Off the compute thread, whose forwards other requests wait for (a grammar compiles).
        sampler = await asyncio.to_thread(TokenSampler, call.sampling, self.vocab_size, self.grammars)
        text = ReplyText.for_request(self.tokenizer, call.sampling)
        feed = ids
        for s in range(budget):
            # Decode steps of concurrent requests run together; a prompt runs on its own.
            key = "decode" if s else object()
            step = _ThinkerStep(st, feed, sampler, prompt)
            choice, embeds, hidden = await self.batcher.submit(key, step)
            tok = choice.token
            data: dict[str, Any] = {"token_ids": torch.tensor([tok])}
            if s == 0:  # [1, P, ...]: the prompt is one unit's worth
                data |= {"prompt_embeds": embeds, "prompt_hidden": hidden} | self._prompt_extras(prompt)
            else:  # [1, hidden]: the position that consumed token s - 1
                data |= {"reply_embeds": embeds[0]}
                if self.sends_reply_hidden:
                    data["reply_hidden"] = hidden[0]
            eos = tok in self.eos
            delta, stopped = text.add(None if eos else tok, last=eos or s == budget - 1)
            done = eos or stopped
            logprobs = [] if eos else token_logprobs(self.tokenizer, choice)
            yield EngineOutput(
                units=1, text=delta, data=data, finish_reason="stop" if done else None, logprobs=logprobs
            )
            if done:
                return
            feed = torch.tensor([[tok]], device=self.device)
        st["finish_reason"] = "length"

    def _prompt_extras(self, prompt: Prompt) -> dict[str, torch.Tensor]:
        """What else of the prompt the talker reads, with the first token."""
        return {}

    def _steps(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        if len(steps) == 1:
            s = steps[0]
            return [self._step(s.st, s.ids, s.sampler, s.prompt)]
        return self._decode_together(steps)

    @torch.inference_mode()
    def _decode_together(self, steps: list[_ThinkerStep]) -> list[tuple[Choice, torch.Tensor, torch.Tensor]]:
        out, caches = decode_together(
            self.model,
            [s.st["past"] for s in steps],
            [self._decode_positions(s.st) for s in steps],
            input_ids=torch.cat([s.ids for s in steps]),
            output_hidden_states=True,
        )
        results = []
        for row, (s, cache) in enumerate(zip(steps, caches, strict=True)):
            s.st["past"] = cache
            choice = s.sampler.pick(out.logits[row, -1])
            first, last = (
                out.hidden_states[0][row : row + 1],
                out.hidden_states[self.talker_layer][row : row + 1],
            )
            results.append((choice, first.float().cpu(), last.float().cpu()))
        return results

    def _decode_positions(self, st: dict[str, Any]) -> torch.Tensor:
        """The next position's 3-D ids: the same on all three axes, offset as the prompt's were."""
        at = st["past"].get_seq_length() + st["rope_deltas"]
        return (torch.arange(1, device=self.device) + at).view(1, 1, -1).expand(3, 1, -1)

    @torch.inference_mode()
    def _step(
        self,
        st: dict[str, Any],
        ids: torch.Tensor,
        sampler: TokenSampler,
        prompt: Prompt,
    ) -> tuple[Choice, torch.Tensor, torch.Tensor]:
        m = self.model
        past = st.get("past")
        inputs: dict[str, torch.Tensor] = {"input_ids": ids}
        if past is None:  # the prompt: its 3-D (M-RoPE) positions, and the offset decoding keeps
            lay = prompt.layout
            positions, st["rope_deltas"] = m.get_rope_index(
                ids,
                lay.image_grid_thw,
                lay.video_grid_thw,
                torch.ones_like(ids),
                False,
                lay.audio_lengths,
                lay.video_second_per_grid,
            )
            if prompt.embeds is not None:
                inputs = self._media_inputs(ids, prompt.embeds)
            else:
                inputs |= prompt.features
        else:
            positions = self._decode_positions(st)
        out = m(
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
            output_hidden_states=True,
            **inputs,
        )
        st["past"] = out.past_key_values
        choice = sampler.pick(out.logits[0, -1])
        # Layer 0 is the input embedding, the last the final (normed) layer: what the talker reads.
        embeds = out.hidden_states[0].float().cpu()
        if past is None and prompt.media_mask is not None:
            # but not the media's features: zeros there, as the reference hands it
            embeds = embeds.masked_fill(prompt.media_mask.cpu()[..., None], 0.0)
        return choice, embeds, out.hidden_states[self.talker_layer].float().cpu()

    def _media_inputs(self, ids: torch.Tensor, media: MediaEmbeds) -> dict[str, Any]:
        """The prefill's inputs with an encoder stage's outputs in place of the media: the
        prompt's input embeddings with them at the media's placeholders, what the model's
        forward makes of the encoders' outputs itself."""
        m = self.model
        embeds = m.get_input_embeddings()(ids)
        kinds = (media.image, media.video, media.audio)  # the order of the masks
        rows = [None if e is None else e.to(self.device, embeds.dtype) for e in kinds]
        masks = m.get_placeholder_mask(ids, embeds, image_features=rows[0], video_features=rows[1])
        for mask, e in zip(masks, rows, strict=True):
            if e is not None:
                embeds = embeds.masked_scatter(mask, e)
        return {"inputs_embeds": embeds}


@dataclass(frozen=True, slots=True)
class _ThinkerStep:
    """One request's next forward: its prompt, or its last token."""

    st: dict[str, Any]
    ids: torch.Tensor
    sampler: TokenSampler
    prompt: Prompt


class Talker(Part):
    part = "talker"
    request_keys = frozenset({"voice"})
    needs_last_call = True  # past the reply it speaks on the thinker's text eos, then its pad
    weights = ("model", "text_embeds")

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        # Decode steps of concurrent requests run together; a prefill runs on its own.
        self.batcher = StepBatcher(self._decodes, self._compute, self.max_batch)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniTalkerForConditionalGeneration

        return Qwen2_5OmniTalkerForConditionalGeneration, self.config.talker_config

    def _load(self) -> None:
        super()._load()
        # The talker's text-side tokens (voice bos, text eos and pad) are rows of the thinker's
        # input embedding table: only that tensor is read, not the thinker.
        c = self.config.talker_config
        self.text_embeds = thinker_embedding_table(self.stage.name, self.path).to(self.device, self.dtype)
        self.text_eos, self.text_pad = c.tts_text_end_token_id, c.tts_text_pad_token_id
        self.codec = {
            "bos": c.tts_codec_start_token_id,
            "end": c.tts_codec_end_token_id,
            "pad": c.tts_codec_pad_token_id,
            "mask": c.tts_codec_mask_token_id,
        }
        self.stop_codes = {self.codec["pad"], self.codec["end"]}

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.state
        self._take(st, call.inputs)
        budget = int(call.sampling.get("max_tokens") or TALKER_MAX_CODES)
        if "past" not in st:
            if "prompt_embeds" not in st or not st["reply"]:
                # The prefill needs token 0's reply state, which comes with token 1: the next
                # window brings it, or, if the reply was one token long, there is nothing to
                # speak (the reference's generate fails on that; a server answers text only).
                return
            voice = self.speaker(call.sampling)
            code = await self._run(self._prefill, st, voice)
            st["codes"] = 0
        else:
            code = None
        while not st.get("done"):
            if code is None:
                step = st["codes"]  # reply state `step` feeds the step after code `step - 1`
                if step < len(st["reply"]):
                    reply = st["reply"][step]
                elif call.is_last:
                    n = len(st["reply"])
                    reply = self._text_embed(self.text_eos if step == n else self.text_pad)
                else:
                    return  # waits for the thinker's next window
                code = await self.batcher.submit("decode", (st, reply))
            if code in self.stop_codes or st["codes"] >= budget:
                st["done"] = True
                return
            st["codes"] += 1
            st["last_code"] = code
            yield EngineOutput(units=1, data={"codes": torch.tensor([code])})
            code = None

    def _take(self, st: dict[str, Any], inputs: dict[str, Any]) -> None:
        """Gather this window's thinker states: the prompt once, and one reply state per token."""
        st.setdefault("reply", [])
        for p in inputs.values():
            if "prompt_embeds" in p and p["prompt_embeds"].shape[0] and "prompt_embeds" not in st:
                st["prompt_embeds"], st["prompt_hidden"] = p["prompt_embeds"][0], p["prompt_hidden"][0]
            if "reply_embeds" in p:
                for e, h in zip(p["reply_embeds"], p["reply_hidden"], strict=True):
                    st["reply"].append((e + h).to(self.device, self.dtype))

    def _text_embed(self, token: int) -> torch.Tensor:
        return self.text_embeds[token]

    @torch.inference_mode()
    def _prefill(self, st: dict[str, Any], voice: dict[str, Any]) -> int:
        embeds = (st["prompt_embeds"] + st["prompt_hidden"]).to(self.device, self.dtype)
        bos = self._text_embed(int(voice["bos_token"]))
        inputs = torch.cat([embeds, bos[None], st["reply"][0][None]]).unsqueeze(0)
        # What the model's codes have "seen" for the repetition penalty: its prompt ids.
        st["seen"] = {self.codec["mask"], self.codec["pad"], self.codec["bos"]}
        return self._forward(st, inputs)

    @torch.inference_mode()
    def _decodes(self, steps: list[tuple[dict[str, Any], torch.Tensor]]) -> list[int]:
        """Each request's next code: its last code's embedding plus its next reply state."""
        inputs = []
        for st, reply in steps:
            code = st["last_code"]
            inputs.append(
                (self.model.get_input_embeddings()(torch.tensor([code], device=self.device)) + reply)[None]
            )
            st["seen"].add(code)
        if len(steps) == 1:
            return [self._forward(steps[0][0], inputs[0])]
        states = [st for st, _ in steps]
        out, caches = decode_together(
            self.model,
            [st["past"] for st in states],
            [self._positions(st, 1) for st in states],
            inputs_embeds=torch.cat(inputs),
        )
        codes = []
        for row, (st, cache) in enumerate(zip(states, caches, strict=True)):
            st["past"] = cache
            codes.append(self._pick(st, out.logits[row, -1].float()))
        return codes

    def _positions(self, st: dict[str, Any], n: int) -> torch.Tensor:
        at = 0 if st.get("past") is None else st["past"].get_seq_length()
        return torch.arange(at, at + n, device=self.device).view(1, 1, -1).expand(3, 1, -1)

    def _forward(self, st: dict[str, Any], inputs: torch.Tensor) -> int:
        positions = self._positions(st, inputs.shape[1])
        out = self.model(
            inputs_embeds=inputs, position_ids=positions, past_key_values=st.get("past"), use_cache=True
        )
        st["past"] = out.past_key_values
        return self._pick(st, out.logits[0, -1].float())

    def _pick(self, st: dict[str, Any], logits: torch.Tensor) -> int:
        """Greedy, with the reference's repetition penalty over every code fed so far and the
        codec bos suppressed."""
        logits = penalise_repeats(logits, st["seen"])
        logits[self.codec["bos"]] = -float("inf")
        return int(torch.argmax(logits))


@dataclass(frozen=True, slots=True)
class _Piece:
    """One stretch of one request's codes to decode, with what the decode needs."""

    codes: torch.Tensor
    noise: torch.Tensor
    cond: torch.Tensor
    ref: torch.Tensor
    samples: slice
    """The stretch's own samples, of those the decode makes (the rest is context)."""


class Token2Wav(Part):
    """The DiT and BigVGAN, on the whole code sequence or in chunks as codes arrive.

    `chunkCodes: 0` (the default) waits for the last code and decodes everything at once,
    exactly as the reference does. `chunkCodes: C` decodes C codes at a time, each chunk with
    `leftContextCodes` before it and `rightContextCodes` after it (waiting for those unless
    the codes have ended), and emits only the chunk's own samples. The DiT's attention is
    block-local, but its ODE applies it 36 times, so context reaches far: a chunk is close to
    the whole decode, not equal (tests/unit/test_qwen_omni.py states how close). Either way the
    starting noise is one draw from the request's seed, sliced, so the whole decode's frames
    get the reference's noise."""

    part = "token2wav"
    request_keys = frozenset({"voice", "seed"})
    needs_last_call = True  # the last chunk waits for right context until the codes end
    sample_rate: Final = 24000

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.chunk = int(self.args.get("chunkCodes", 0))
        self.left = int(self.args.get("leftContextCodes", 24))
        self.right = int(self.args.get("rightContextCodes", 12))
        self.batcher = StepBatcher(self._synthesize, self._compute, self.max_batch)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniToken2WavModel

        return Qwen2_5OmniToken2WavModel, self.config.token2wav_config

    def _load(self) -> None:
        super()._load()
        self.model.float()  # the reference runs token2wav in float32 whatever the rest is
        dit = self.model.code2wav_dit_model
        self.repeats, self.mel_dim = dit.repeats, dit.mel_dim
        rates = self.config.token2wav_config.bigvgan_config.upsample_rates
        self.samples_per_frame = int(torch.tensor(rates).prod())

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.state
        for p in call.inputs.values():
            if "codes" in p and p["codes"].numel():
                st.setdefault("codes", []).append(p["codes"].long())
        if "codes" not in st:
            return
        codes = torch.cat(st["codes"])
        st["codes"] = [codes]
        done = st.get("done", 0)
        while done < len(codes):
            end = len(codes) if self.chunk <= 0 else min(done + self.chunk, len(codes))
            if not call.is_last and (self.chunk <= 0 or end + self.right > len(codes)):
                return  # wait for the rest, or for this chunk's right context
            piece = self._piece(
                st, codes, done, end, self.speaker(call.sampling), int(call.sampling.get("seed", 0) or 0)
            )
            # Pieces of the same length and voice, from any requests, stack into one decode.
            wav = await self.batcher.submit((piece.codes.shape[0], self.voice(call.sampling)), piece)
            yield EngineOutput(units=end - done, data={"audio": wav, "sample_rate": self.sample_rate})
            done = st["done"] = end

    def _piece(
        self, st: dict[str, Any], codes: torch.Tensor, start: int, end: int, voice: dict[str, Any], seed: int
    ) -> _Piece:
        """What decoding codes [start, end) takes: the codes with their context [lo, hi) and
        that stretch's noise."""
        lo = 0 if self.chunk <= 0 else max(0, start - self.left)
        hi = len(codes) if self.chunk <= 0 else min(len(codes), end + self.right)
        frames = hi * self.repeats
        if st.get("noise") is None or st["noise"].shape[1] < frames:
            # The reference draws randn([1, frames, mel]) after manual_seed(seed); a longer draw
            # from the same seed begins with the shorter one, so slices of it are the same noise.
            gen = torch.Generator().manual_seed(seed)
            st["noise"] = torch.randn([1, frames, self.mel_dim], generator=gen)
        per_code = self.repeats * self.samples_per_frame
        return _Piece(
            codes[lo:hi],
            st["noise"][0, lo * self.repeats : frames],
            voice["cond"].float(),
            voice["ref_mel"].float(),
            slice((start - lo) * per_code, (end - lo) * per_code),
        )

    @torch.inference_mode()
    def _synthesize(self, pieces: list[_Piece]) -> list[torch.Tensor]:
        """Pieces of one length and voice, as one batch: the DiT and BigVGAN on [B, ...]."""
        stack = lambda xs: torch.stack(xs).to(self.device)  # noqa: E731
        mel = self._dit(
            stack([p.codes for p in pieces]),
            stack([p.cond for p in pieces]),
            stack([p.ref for p in pieces]),
            stack([p.noise for p in pieces]),
        )
        wav = self.model.code2wav_bigvgan_model(mel).reshape(len(pieces), -1)
        return [w[p.samples].float().cpu() for w, p in zip(wav, pieces, strict=True)]

    def _dit(
        self, codes: torch.Tensor, cond: torch.Tensor, ref: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """Qwen2_5OmniToken2WavDiTModel.sample with its defaults (10 steps, guidance 0.5, sway
        -1), from the given starting noise instead of a fresh draw."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        guidance, sway, steps = 0.5, -1.0, 10
        cond = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

        def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            out = dit(
                hidden_states=x,
                quantized_code=codes,
                speaker_embedding=cond,
                condition_vector=ref,
                time_step=t,
                apply_cfg=True,
            )
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance

        t = torch.linspace(0, 1, steps, device=noise.device, dtype=cond.dtype)
        t = t + sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1].permute(0, 2, 1)
