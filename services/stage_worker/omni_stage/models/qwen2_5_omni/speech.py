"""Qwen2.5-Omni's talker and token2wav (see the package's docstring)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from omni_pipeline.payloads import Audio, Codes, ThinkerStep
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.prompt_cache import Sequence, same_rows
from omni_stage.engines.slot_cache import warm_up
from omni_stage.models.qwen2_5_omni.dit import CachedDiT, LeftContext, Solve, Window
from omni_stage.models.qwen_omni.parts import (
    TALKER_MAX_CODES,
    FirstChunk,
    Part,
    SeenCodes,
    Vocoding,
    chunk_args,
    code_mask,
    compiler,
    compiles,
)
from omni_stage.models.qwen_omni.slots import HoldsSlot, SlotPart
from omni_stage.segments import EngineOutput


@dataclass(slots=True)
class _Speaking(HoldsSlot):
    """A talker's request: the thinker's prompt states, one reply state per token so far, its
    cache's slot, and the codes made (the last one still to feed)."""

    reply: list[torch.Tensor] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    made: int = 0
    last_code: int = 0
    done: bool = False
    key: str | None = None
    """The conversation's `prompt_cache_key`: what the talker is fed is kept under it."""
    prompt_rows: torch.Tensor | None = None
    """With a key, the prompt's input rows [P, H]: what the conversation's next turn begins
    with (its reply and codes the next turn's prompt does not repeat)."""
    kept: bool = False


@dataclass(frozen=True, slots=True)
class _Prefill:
    """A request's talker prompt to prefill (with those queued beside it, `prefillBatchTokens`):
    its state and its voice."""

    st: _Speaking
    voice: dict[str, Any]


class Talker(SlotPart):
    """Speaks the thinker's reply. With a `prompt_cache_key` it keeps its prompt's positions: the
    next turn's prompt begins with them, fed the same thinker rows (the thinker's own kept
    ones), so its prefill computes the rest only (prompt_cache.py)."""

    part = "talker"
    request_keys = params("voice", "prompt_cache_key")
    needs_last_call = True  # past the reply it speaks on the thinker's text eos, then its pad
    weights = ("model", "text_embeds")

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        # Decode steps of concurrent requests run together; their prompts' prefills too, with
        # `prefillBatchTokens` (a conversation's kept sequence resumed: alone).
        self.batcher = StepBatcher(self._decodes, self._compute, self.max_batch)
        self.prefills = StepBatcher(self._prefills, self._compute, self.max_batch)
        self.prompt_caches = self._kept_conversations()
        self.compiled = compiler(stage, graphs=False)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniTalkerForConditionalGeneration

        return Qwen2_5OmniTalkerForConditionalGeneration, self.config.talker_config

    def _load(self) -> None:
        super()._load()
        # The talker's text-side tokens (voice bos, text eos and pad) are rows of the thinker's
        # input embedding table: only that tensor is read, not the thinker.
        c = self.config.talker_config
        self.text_embeds = self._thinker_embeddings()
        self.text_eos, self.text_pad = c.tts_text_end_token_id, c.tts_text_pad_token_id
        self.codec = {
            "bos": c.tts_codec_start_token_id,
            "end": c.tts_codec_end_token_id,
            "pad": c.tts_codec_pad_token_id,
            "mask": c.tts_codec_mask_token_id,
        }
        self.stop_codes = {self.codec["pad"], self.codec["end"]}
        vocab = int(c.vocab_size)
        self.never = code_mask(vocab, [self.codec["bos"]], self.device)
        self.seen_codes = SeenCodes(vocab, self.device)
        self.model.model = self.compiled(self.model.model)  # its decoder layers (`compile`)
        width = self.model.get_input_embeddings().weight.shape[1]
        self._build_slots(c, self.model, width, 3)
        if compiles(self.stage):
            with torch.inference_mode():  # as requests run it: a compile is guarded on the mode
                assert self.stepper is not None
                warm_up(self.stepper, width, self._span, together=self.prefill_tokens > 0)

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.kept(_Speaking)
        with self._keeping_if_cut(st):  # a barge-in: what it made is kept
            self._take(st, call.inputs)
            budget = call.sampling.max_tokens or TALKER_MAX_CODES
            if st.slot is None and not st.done:
                if st.prompt_embeds is None or not st.reply:
                    # The prefill needs token 0's reply state, which comes with token 1: the next
                    # window brings it, or, if the reply was one token long, there is nothing to
                    # speak (the reference's generate fails on that; a server answers text only).
                    return
                voice = self.speaker(call.sampling)
                kept = None
                if (key := call.sampling.prompt_cache_key) is not None and self.prompt_caches.capacity:
                    st.key = str(key)
                    kept = await self.prompt_caches.take(st.key)  # on the loop, as every use of the caches
                if kept is None and self.prefill_tokens:
                    code = await self.prefills.submit("prefill", _Prefill(st, voice))
                else:
                    code = await self._run(self._prefill, st, voice, kept)
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
                if code in self.stop_codes or st.made >= budget or st.full:
                    st.done = True
                    self._keep(st)  # complete: kept for the conversation's next turn
                    self._give_back(st)
                    return
                st.made += 1
                st.last_code = code
                yield EngineOutput(units=1, data=Codes(codes=torch.tensor([code])))
                code = None

    def _keep(self, st: _Speaking) -> None:
        """The prompt's positions of the sequence, kept for the conversation's next turn."""
        if (
            st.key is None
            or st.kept
            or st.slot is None
            or st.prompt_rows is None
            or self.prompt_caches is None
        ):
            return
        st.kept = True
        self.prompt_caches.keep(st.key, Sequence.left([], self._held(st), [], {"fed": st.prompt_rows}))

    def _take(self, st: _Speaking, inputs: dict[str, ThinkerStep]) -> None:
        """Gather this window's thinker states: the prompt once, and one reply state per token."""
        for p in inputs.values():
            if "prompt_embeds" in p and p["prompt_embeds"].shape[0] and st.prompt_embeds is None:
                st.prompt_embeds, st.prompt_hidden = p["prompt_embeds"][0], p["prompt_hidden"][0]
            if "reply_embeds" in p:
                for e, h in zip(p["reply_embeds"], p["reply_hidden"], strict=True):
                    st.reply.append((e + h).to(self.device, self.dtype))

    def _text_embed(self, token: int) -> torch.Tensor:
        return self.text_embeds[token]

    def _prompt(self, st: _Speaking, voice: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The talker's input rows [n, H]: the prompt, the voice's bos and the first reply
        state; and how many are the prompt's (with a key, those rows are set on it)."""
        assert st.prompt_embeds is not None and st.prompt_hidden is not None
        embeds = (st.prompt_embeds + st.prompt_hidden).to(self.device, self.dtype)
        bos = self._text_embed(int(voice["bos_token"]))
        if st.key is not None:
            st.prompt_rows = embeds
        return torch.cat([embeds, bos[None], st.reply[0][None]]), len(embeds)

    def _start_codes(self, slot: int) -> None:
        """What the model's codes have "seen" for the repetition penalty: its prompt ids."""
        self.seen_codes.start(slot, [self.codec["mask"], self.codec["pad"], self.codec["bos"]])

    @torch.inference_mode()
    def _prefill(self, st: _Speaking, voice: dict[str, Any], seq: Sequence | None) -> int:
        """The talker's prompt; on `seq`, the conversation's kept sequence, as far as this
        prompt's rows are the ones it was fed."""
        inputs, prompt = self._prompt(st, voice)
        # At most the prompt's rows: the voice's bos and the first reply state are this turn's.
        past, at = None, 0
        if seq is not None and (n := min(same_rows(seq.rows["fed"], inputs), prompt)):
            seq.cut(n)
            past, at, inputs = seq.past, n, inputs[n:]
            self.prompt_caches.reused_tokens += n
        assert self.stepper is not None
        slot = self.slot_of(st)
        self._start_codes(slot)
        out = self.stepper.prefill(
            slot, past, self._span(at, len(inputs)), inputs[None], self.model.codec_head
        )
        [code] = self._picks([st], out.logits[:, -1])
        return code

    @torch.inference_mode()
    def _prefills(self, prefills: list[_Prefill]) -> list[int]:
        """Prompts that queued together, on new caches, in forwards of prompts of about one
        length (`prefillBatchTokens` positions at most; SlotSteps.prefill_together), their first
        codes picked together; one alone as `_prefill`."""
        if len(prefills) == 1:
            return [self._prefill(prefills[0].st, prefills[0].voice, None)]
        sts = [p.st for p in prefills]
        inputs = [self._prompt(p.st, p.voice)[0][None] for p in prefills]
        slots = [self.slot_of(st) for st in sts]
        for slot in slots:
            self._start_codes(slot)
        assert self.stepper is not None
        positions = [self._span(0, x.shape[1]) for x in inputs]
        ends = self.stepper.prefill_together(
            slots, positions, inputs, self.prefill_tokens, self.model.codec_head
        )
        return self._picks(sts, torch.stack([e.output.logits[e.row, -1] for e in ends]))

    @torch.inference_mode()
    def _decodes(self, steps: list[tuple[_Speaking, torch.Tensor]]) -> list[int]:
        """Each request's next code: its last code's embedding plus its next reply state."""
        sts = [st for st, _ in steps]
        codes = torch.tensor([st.last_code for st in sts], device=self.device)
        inputs = (self.model.get_input_embeddings()(codes) + torch.stack([r for _, r in steps]))[:, None]
        assert self.slots is not None and self.stepper is not None
        slots = [self.slot_of(st) for st in sts]
        at = [self.slots.lengths[s] for s in slots]  # [3, B, 1]: M-RoPE's rows alike for text
        out, rows = self.stepper.step(
            slots, torch.tensor([at, at, at], device=self.device)[..., None], inputs
        )
        return self._picks(sts, out.logits[rows, -1])

    def _span(self, at: int, n: int) -> torch.Tensor:
        """[3, 1, n]: the M-RoPE position ids of n positions from `at` (text: every row alike)."""
        return torch.arange(at, at + n, device=self.device).view(1, 1, -1).expand(3, 1, -1)

    def _picks(self, sts: list[_Speaking], logits: torch.Tensor) -> list[int]:
        """Each request's code from its row of `logits` [B, vocab]: greedy, with the reference's
        repetition penalty over its prompt's codes and every code picked so far (each fed back
        before the next pick) and the codec bos suppressed."""
        return self.seen_codes.greedy(logits.float(), [self.slot_of(st) for st in sts], self.never)


@dataclass(slots=True, eq=False)
class _Piece:
    """One stretch of one request's codes to decode: the DiT's window (the chunk and its right
    context), the mel the vocoder reads before it, and its solve once begun: step by step, then
    BigVGAN."""

    window: Window
    own: int
    """The chunk's own frames, of the window's (the rest is right context)."""
    keep: bool
    """Whether a chunk follows, which needs what this one keeps."""
    mel_before: torch.Tensor
    voice: str
    solve: Solve | None = None

    def key(self) -> Hashable:
        """What pieces must share to go as one batch: solving (at any step) or vocoding (first:
        `maxVocodeBatch` reads it), the shapes and the voice."""
        w = self.window
        left = w.left.frames if w.left is not None else 0
        vocoding = self.solve is not None and self.solve.solved
        return (vocoding, w.codes.shape[0], self.own, left, self.mel_before.shape[0], self.keep, self.voice)


@dataclass(frozen=True, slots=True)
class _Decoded:
    audio: torch.Tensor
    left: LeftContext | None
    mel: torch.Tensor | None


@dataclass(slots=True)
class _Token2WavState(Vocoding):
    """Token2wav's request: its codes, the starting noise drawn so far from its seed, and what
    the next chunk reads of the frames decoded before it (the DiT's look-back layers' inputs,
    the vocoder's mel)."""

    noise: torch.Tensor | None = None
    left: LeftContext | None = None
    mel: torch.Tensor | None = None
    first: int = 0
    """The first chunk's codes, picked by the load when the first codes came (0: not yet)."""


class Token2Wav(Part):
    """The DiT and BigVGAN, on the whole code sequence or in chunks as codes arrive.

    `chunkCodes: 0` (the default) waits for the last code and decodes everything at once, as
    the reference does. `chunkCodes: C` decodes the first C codes (a multiple of the DiT's
    block) as soon as they and `rightContextCodes` after them are there, then chunks as long
    as the audio before them up to `maxChunkCodes` (C by default), each emitting only its own
    samples. The first chunk is C on an idle replica, more as its compute fills, up to
    `busyFirstChunkCodes` (`maxChunkCodes` by default): each chunk costs its right context and
    a call, which under load cost throughput (parts.FirstChunk). Nothing before a chunk is
    decoded again: the DiT's look-back layers read what the request kept of the chunk before
    (dit.py), and BigVGAN reads `leftContextCodes` of mel already made. Either way the starting
    noise is one draw from the request's seed, sliced, so the whole decode's frames get the
    reference's noise.

    `compile: true` runs the DiT's layers and BigVGAN through `torch.compile` (off by default:
    it compiles at start, every form a request runs (`_warm_up`), and again on waking from a
    level-2 sleep; on this CPU it halves their time, within 1e-6 of not compiling);
    `compile: reduce-overhead` also replays them as CUDA graphs on a GPU (parts.compiler).

    `maxVocodeBatch` (default `maxBatch`): the most chunks BigVGAN vocodes in one call. A
    newcomer's first chunk goes before others' pieces, but only once the call running ends,
    and BigVGAN on a batch of long chunks is the longest call there is; fewer a call shortens
    that wait (TTFP under load) for less batching (throughput)."""

    part = "token2wav"
    request_keys = params("voice", "seed")
    weights = ("model", "dit", "vocoder")  # the last two hold the model's own modules
    needs_last_call = True  # the last chunk waits for right context until the codes end
    sample_rate: Final = 24000

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.chunk, self.left, self.right = chunk_args(stage, 0, 10, 12, least_chunk=0)  # 0: whole
        self.max_chunk = int(self.args.get("maxChunkCodes", self.chunk))
        self.compiled = compiler(stage)
        if self.chunk > 0 and self.max_chunk < self.chunk:
            raise EngineError(f"stage '{stage.name}': maxChunkCodes must be at least chunkCodes")
        self.first_chunk: FirstChunk | None = None  # (at load: its step is the DiT's block)
        self.max_vocode = int(self.args.get("maxVocodeBatch", self.max_batch))
        if self.max_vocode < 1:
            raise EngineError(f"stage '{stage.name}': maxVocodeBatch must be at least 1")
        self.batcher = StepBatcher(
            self._synthesize,
            self._compute,
            self.max_batch,
            lambda key: self.max_vocode if key[0] else self.max_batch,
        )

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5OmniToken2WavModel

        return Qwen2_5OmniToken2WavModel, self.config.token2wav_config

    def _load(self) -> None:
        super()._load()
        self.model.float()  # the reference runs token2wav in float32 whatever the rest is
        self.dit = CachedDiT(self.model.code2wav_dit_model, self.compiled)
        self.vocoder = self.compiled(self.model.code2wav_bigvgan_model)
        self.repeats, self.mel_dim = self.dit.dit.repeats, self.dit.dit.mel_dim
        unit = self.dit.block // math.gcd(self.dit.block, self.repeats)  # codes a DiT block
        for name, n in (("chunkCodes", self.chunk), ("maxChunkCodes", self.max_chunk)):
            if self.chunk > 0 and n % unit:
                raise EngineError(
                    f"stage '{self.stage.name}': {name} must be a multiple of {unit} (the DiT's "
                    f"blocks of {self.dit.block} frames, {self.repeats} frames a code)"
                )
        if self.chunk > 0:
            self.first_chunk = FirstChunk.of(self.stage, self.chunk, self.max_chunk, "maxChunkCodes", unit)
        elif asked := [k for k in ("firstChunkCodes", "busyFirstChunkCodes") if k in self.args]:
            raise EngineError(f"stage '{self.stage.name}': {asked[0]} sizes a first chunk: set chunkCodes")
        rates = self.config.token2wav_config.bigvgan_config.upsample_rates
        self.samples_per_frame = int(torch.tensor(rates).prod())
        self.upsample = self.repeats * self.samples_per_frame  # samples a code

    async def start(self) -> None:
        await super().start()
        await self._warm_up()

    async def wake_up(self, level: int) -> None:
        await super().wake_up(level)
        if level >= 2:  # loaded again: compiled again
            await self._warm_up()

    async def _warm_up(self) -> None:
        """With `compile`: silence decoded as requests are, alone and two together (a first
        chunk, growing ones, a short last one), so that what a request runs compiles now,
        before the replica is ready, not at the first requests."""
        if not compiles(self.stage):
            return
        n = self.chunk + 2 * self.max_chunk + self.right + 1  # every chunk size, and a last one
        silence = {"talker": {"codes": torch.zeros(n, dtype=torch.long)}}

        async def decode() -> None:
            async for _ in self.generate(EngineCall("warm-up", silence, True, Sampling())):
                pass

        await decode()
        await asyncio.gather(decode(), decode())

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.kept(_Token2WavState)
        if (codes := st.gather(call.inputs)) is None:
            return
        done = st.decoded
        while done < len(codes):
            end = len(codes) if self.chunk <= 0 else min(done + self._chunk_after(st, done), len(codes))
            if not call.is_last and (self.chunk <= 0 or end + self.right > len(codes)):
                return  # wait for the rest, or for this chunk's right context
            piece = self._piece(st, codes, done, end, call)
            # Pieces of the same shape and voice, from any requests, go as one batch, a solver
            # step at a time (each at its own step), then vocoded; a request's first chunk goes
            # ahead of later ones (its listener hears nothing yet).
            while (out := await self.batcher.submit(piece.key(), piece, first=done == 0)) is None:
                pass  # a step of its solve done; more to go
            st.left, st.mel = out.left, out.mel
            yield EngineOutput(units=end - done, data=Audio(audio=out.audio, sample_rate=self.sample_rate))
            done = st.decoded = end

    def _chunk_after(self, st: _Token2WavState, done: int) -> int:
        """Codes in the chunk after the first `done`: the first chunk's by the replica's load
        when the request's first codes came (FirstChunk: chunkCodes idle, up to
        `busyFirstChunkCodes`, maxChunkCodes by default), then as many as came before it (the
        audio already out plays while the next is made), from chunkCodes up to maxChunkCodes."""
        if not done:
            if not st.first:
                assert self.first_chunk is not None
                st.first = self.first_chunk.codes(self.batcher.occupancy())
            return st.first
        return min(max(done, self.chunk), self.max_chunk)

    def _piece(
        self, st: _Token2WavState, codes: torch.Tensor, start: int, end: int, call: EngineCall
    ) -> _Piece:
        """What decoding codes [start, end) takes: the codes with their right context, that
        stretch's noise, and what was kept of the frames before it."""
        hi = len(codes) if self.chunk <= 0 else min(len(codes), end + self.right)
        frames = hi * self.repeats
        if st.noise is None or st.noise.shape[1] < frames:
            # The reference draws randn([1, frames, mel]) after manual_seed(seed); a longer draw
            # from the same seed begins with the shorter one, so slices of it are the same noise.
            # Twice as long as asked each time: a long request draws O(log n) times, not per chunk.
            seed = call.sampling.seed or 0
            longer = frames if st.noise is None or self.chunk <= 0 else max(frames, 2 * st.noise.shape[1])
            st.noise = torch.randn([1, longer, self.mel_dim], generator=torch.Generator().manual_seed(seed))
        voice = self.speaker(call.sampling)
        before = st.mel if start and st.mel is not None else torch.zeros(0, self.mel_dim)
        window = Window(
            codes[start:hi],
            st.noise[0, start * self.repeats : frames],
            voice["cond"].float(),
            voice["ref_mel"].float(),
            start * self.repeats,
            st.left if start else None,
        )
        keep = self.chunk > 0 and not (call.is_last and end == len(codes))
        return _Piece(window, (end - start) * self.repeats, keep, before, self.voice(call.sampling))

    @torch.inference_mode()
    def _synthesize(self, pieces: list[_Piece]) -> list[_Decoded | None]:
        """Pieces of one shape and voice, as one batch: a step of each one's DiT solve, wherever
        it is (None: more to do), or, once solved, BigVGAN on [B, ...] (their audio)."""
        if pieces[0].solve is None or not pieces[0].solve.solved:
            new = [p for p in pieces if p.solve is None]
            if new:
                keep_at = new[0].own if new[0].keep else None
                for p, solve in zip(new, self.dit.begin([p.window for p in new], keep_at), strict=True):
                    p.solve = solve
            self.dit.step([p.solve for p in pieces])  # type: ignore[misc]
            return [None] * len(pieces)
        solves = [p.solve for p in pieces]
        own, keep = pieces[0].own, pieces[0].keep
        mel = torch.stack([s.x for s in solves])  # type: ignore[union-attr]
        before = torch.stack([p.mel_before for p in pieces]).to(mel.device)
        mel = torch.cat([before, mel], dim=1)
        wav = self.vocoder(mel.permute(0, 2, 1)).reshape(len(pieces), -1)
        m, per, tail = before.shape[1], self.samples_per_frame, self.left * self.repeats
        return [
            _Decoded(
                wav[r, m * per : (m + own) * per].float().cpu(),
                s.left_context() if keep else None,  # type: ignore[union-attr]
                mel[r, max(0, m + own - tail) : m + own].cpu().clone() if keep else None,
            )
            for r, s in enumerate(solves)
        ]
