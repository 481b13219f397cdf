"""Qwen3's code2wav stage: Qwen3-Omni's Code2Wav (and, by a subclass, Qwen3-TTS's speech
tokenizer decoder) decoding each request's codes as a stream (streaming.py), in pieces as they
come: each code decoded once, every sample the whole decode's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import Any, Final

import torch

from omni_pipeline.payloads import Audio
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.models.qwen3_omni.streaming import DecoderStream, Streams, vocoded
from omni_stage.models.qwen_omni.parts import FirstChunk, Part, Vocoding
from omni_stage.segments import EngineOutput

SMALLEST_FIRST_CHUNK: Final = 1
"""The fewest codes a first piece decodes: the decoders are causal (a sample depends on the codes
up to its own), so a decode of n codes has final samples from the first code on (Qwen3-Omni's
Code2Wav all but its last 555, the speech tokenizer's decoder all; docs/models.md)."""
DEFAULT_CHUNK: Final = 25
"""Codes a piece once audio is going (2 s): vLLM-Omni's chunk for Qwen3-TTS."""


@dataclass(slots=True)
class _Streaming(Vocoding):
    """A code2wav request: its codes, its place in the decode, and whether audio went out."""

    stream: DecoderStream | None = None
    first: int = 0
    """The first voiced piece's codes, picked by the load when it is due (0: not yet)."""
    voiced: bool = False


@dataclass(frozen=True, slots=True)
class _Piece:
    stream: DecoderStream
    codes: torch.Tensor
    """[groups, n]: the codes after those the stream has decoded."""

    def key(self) -> Hashable:
        """What pieces must share to go as one batch: their length, and whether their streams
        start with them (a stream's first piece cuts what its decode's start leaves out)."""
        return self.codes.shape[-1], self.stream.seen == 0


class Qwen3Code2Wav(Part):
    """The decoder as a stream: a first piece sized by the load (`firstChunkCodes`, one code by
    default: its samples are final at once), with the codes a request opens with as context
    before it (a cloned voice's clip: decoded, never voiced), then `chunkCodes` at a time.
    Pieces of one length from several requests decode as one batch, each request from its own
    place. No context is decoded again: `leftContextCodes` and `rightContextCodes` are
    refused."""

    part = "code2wav"
    config_class = "Qwen3OmniMoeConfig"
    model_name = "Qwen3-Omni"
    needs_last_call = True  # the last piece waits for the codes to end
    sample_rate: Final = 24000

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        for name in ("leftContextCodes", "rightContextCodes"):
            if name in self.args:
                raise EngineError(
                    f"stage '{stage.name}': engine.args.{name}: {self.model_name}'s decoder streams, each "
                    "code decoded once from what the codes before it left (no context decoded again): "
                    "leave it out"
                )
        self.chunk = int(self.args.get("chunkCodes", DEFAULT_CHUNK))
        if self.chunk < SMALLEST_FIRST_CHUNK:
            raise EngineError(f"stage '{stage.name}': chunkCodes must be at least {SMALLEST_FIRST_CHUNK}")
        self.first_chunk = FirstChunk.of(stage, SMALLEST_FIRST_CHUNK, self.chunk)
        self.batcher = StepBatcher(self._decode, self._compute, self.max_batch)

    def _part_class(self) -> tuple[Any, Any]:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        return Qwen3OmniMoeCode2Wav, self.config.code2wav_config

    def _load(self) -> None:
        super()._load()
        m = self.model.float()

        def embed(codes: torch.Tensor) -> torch.Tensor:
            return m.code_embedding(codes + m.code_offset).mean(1)

        m.streams = Streams(m, m.pre_transformer, embed, lambda hidden: vocoded(m, hidden))
        self.upsample = int(m.total_upsample)

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        st = call.kept(_Streaming)
        if (codes := st.gather(call.inputs)) is None:  # [n, groups]
            return
        while (end := self._piece_end(st, len(codes), call.is_last)) is not None:
            begin = st.decoded
            if st.stream is None:
                st.stream = self.model.streams.start()
            piece = _Piece(st.stream, codes[begin:end].T)
            wav = await self.batcher.submit(piece.key(), piece, first=not st.voiced)
            st.decoded = end
            if end > st.context:  # the codes it opens with are the decoder's context, never voiced
                st.voiced = True
                skip = max(0, st.context - begin) * self.upsample
                audio = Audio(audio=wav[skip:], sample_rate=self.sample_rate)
                yield EngineOutput(units=end - max(begin, st.context), data=audio)

    def _piece_end(self, st: _Streaming, have: int, ended: bool) -> int | None:
        """Where the next piece ends: the first piece's codes (by the load) past the context,
        which goes with them, then `chunkCodes` more at a time (every piece after the first the
        same length, whatever the first: they batch across requests; and with the edge's first
        window of one code, each comes whole with a window); at the last code once the codes
        end; None: nothing to decode yet."""
        at = st.decoded
        if at >= have or have <= st.context:  # all decoded, or nothing to voice yet
            return None
        if not st.voiced:
            if not st.first:
                st.first = self.first_chunk.codes(self.batcher.occupancy())
            end = max(at, st.context) + st.first
        else:
            end = at + self.chunk
        if end <= have:
            return end
        return have if ended else None

    @torch.inference_mode()
    def _decode(self, pieces: list[_Piece]) -> list[torch.Tensor]:
        """Pieces of one key, as one batch, each from its own stream's place."""
        codes = torch.stack([p.codes for p in pieces]).to(self.device)
        wav = self.model.streams.decode(codes, [p.stream for p in pieces])
        return [w[0].float().cpu() for w in wav]
