"""Qwen2.5-Omni's talker and token2wav (see the package's docstring)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.kv_batch import decode_together
from omni_stage.models.qwen_omni.parts import (
    TALKER_MAX_CODES,
    Part,
    Vocoding,
    chunk_args,
    penalise_repeats,
    thinker_embedding_table,
)
from omni_stage.segments import EngineOutput


@dataclass(slots=True)
class _Speaking:
    """A talker's request: the thinker's prompt states, one reply state per token so far, the
    cache, and the codes made (the last one still to feed; `seen`: what the repetition penalty
    counts)."""

    reply: list[torch.Tensor] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    past: Any = None
    made: int = 0
    last_code: int = 0
    seen: set[int] = field(default_factory=set)
    done: bool = False


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
        st = call.kept(_Speaking)
        self._take(st, call.inputs)
        budget = int(call.sampling.get("max_tokens") or TALKER_MAX_CODES)
        if st.past is None:
            if st.prompt_embeds is None or not st.reply:
                # The prefill needs token 0's reply state, which comes with token 1: the next
                # window brings it, or, if the reply was one token long, there is nothing to
                # speak (the reference's generate fails on that; a server answers text only).
                return
            voice = self.speaker(call.sampling)
            code = await self._run(self._prefill, st, voice)
        else:
            code = None
        while not st.done:
            if code is None:
                step = st.made  # reply state `step` feeds the step after code `step - 1`
                if step < len(st.reply):
                    reply = st.reply[step]
                elif call.is_last:
                    n = len(st.reply)
                    reply = self._text_embed(self.text_eos if step == n else self.text_pad)
                else:
                    return  # waits for the thinker's next window
                code = await self.batcher.submit("decode", (st, reply))
            if code in self.stop_codes or st.made >= budget:
                st.done = True
                return
            st.made += 1
            st.last_code = code
            yield EngineOutput(units=1, data={"codes": torch.tensor([code])})
            code = None

    def _take(self, st: _Speaking, inputs: dict[str, Any]) -> None:
        """Gather this window's thinker states: the prompt once, and one reply state per token."""
        for p in inputs.values():
            if "prompt_embeds" in p and p["prompt_embeds"].shape[0] and st.prompt_embeds is None:
                st.prompt_embeds, st.prompt_hidden = p["prompt_embeds"][0], p["prompt_hidden"][0]
            if "reply_embeds" in p:
                for e, h in zip(p["reply_embeds"], p["reply_hidden"], strict=True):
                    st.reply.append((e + h).to(self.device, self.dtype))

    def _text_embed(self, token: int) -> torch.Tensor:
        return self.text_embeds[token]

    @torch.inference_mode()
    def _prefill(self, st: _Speaking, voice: dict[str, Any]) -> int:
        assert st.prompt_embeds is not None and st.prompt_hidden is not None
        embeds = (st.prompt_embeds + st.prompt_hidden).to(self.device, self.dtype)
        bos = self._text_embed(int(voice["bos_token"]))
        inputs = torch.cat([embeds, bos[None], st.reply[0][None]]).unsqueeze(0)
        # What the model's codes have "seen" for the repetition penalty: its prompt ids.
        st.seen = {self.codec["mask"], self.codec["pad"], self.codec["bos"]}
        return self._forward(st, inputs)

    @torch.inference_mode()
    def _decodes(self, steps: list[tuple[_Speaking, torch.Tensor]]) -> list[int]:
        """Each request's next code: its last code's embedding plus its next reply state."""
        inputs = []
        for st, reply in steps:
            code = st.last_code
            inputs.append(
                (self.model.get_input_embeddings()(torch.tensor([code], device=self.device)) + reply)[None]
            )
            st.seen.add(code)
        if len(steps) == 1:
            return [self._forward(steps[0][0], inputs[0])]
        states = [st for st, _ in steps]
        out, caches = decode_together(
            self.model,
            [st.past for st in states],
            [self._positions(st, 1) for st in states],
            inputs_embeds=torch.cat(inputs),
        )
        codes = []
        for row, (st, cache) in enumerate(zip(states, caches, strict=True)):
            st.past = cache
            codes.append(self._pick(st, out.logits[row, -1].float()))
        return codes

    def _positions(self, st: _Speaking, n: int) -> torch.Tensor:
        at = 0 if st.past is None else st.past.get_seq_length()
        return torch.arange(at, at + n, device=self.device).view(1, 1, -1).expand(3, 1, -1)

    def _forward(self, st: _Speaking, inputs: torch.Tensor) -> int:
        positions = self._positions(st, inputs.shape[1])
        out = self.model(
            inputs_embeds=inputs, position_ids=positions, past_key_values=st.past, use_cache=True
        )
        st.past = out.past_key_values
        return self._pick(st, out.logits[0, -1].float())

    def _pick(self, st: _Speaking, logits: torch.Tensor) -> int:
        """Greedy, with the reference's repetition penalty over every code fed so far and the
        codec bos suppressed."""
        logits = penalise_repeats(logits, st.seen)
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


@dataclass(slots=True)
class _Token2WavState(Vocoding):
    """Token2wav's request: its codes, and the starting noise drawn so far from its seed."""

    noise: torch.Tensor | None = None


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
        self.chunk, self.left, self.right = chunk_args(stage, 0, 24, 12, least_chunk=0)  # 0: whole
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
        st = call.kept(_Token2WavState)
        if (codes := st.gather(call.inputs)) is None:
            return
        done = st.decoded
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
            done = st.decoded = end

    def _piece(
        self, st: _Token2WavState, codes: torch.Tensor, start: int, end: int, voice: dict[str, Any], seed: int
    ) -> _Piece:
        """What decoding codes [start, end) takes: the codes with their context [lo, hi) and
        that stretch's noise."""
        lo = 0 if self.chunk <= 0 else max(0, start - self.left)
        hi = len(codes) if self.chunk <= 0 else min(len(codes), end + self.right)
        frames = hi * self.repeats
        if st.noise is None or st.noise.shape[1] < frames:
            # The reference draws randn([1, frames, mel]) after manual_seed(seed); a longer draw
            # from the same seed begins with the shorter one, so slices of it are the same noise.
            gen = torch.Generator().manual_seed(seed)
            st.noise = torch.randn([1, frames, self.mel_dim], generator=gen)
        per_code = self.repeats * self.samples_per_frame
        return _Piece(
            codes[lo:hi],
            st.noise[0, lo * self.repeats : frames],
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
