"""Deterministic fake compute with a configurable cost and output size, for tests and benchmarks.

Arguments (`engine.args`):
  unitsPerCall      units a source stage produces (default: sampling.max_tokens, else 16)
  unitsPerInputUnit units produced per input unit on a consumer stage (default 1.0)
  msPerUnit, msPerCall   simulated compute time (sleeps: it stands in for a GPU)
  hiddenSize        floats per unit in a `hidden_states` tensor (default 0: none)
  samplesPerUnit    audio samples per unit, for stages whose finalOutput is audio (default 240)
  sampleRate        audio sample rate (default 24000)
  failOn            fail any request whose input text contains this string (poisoned input)
  hangOn            a request whose input text contains this string wedges the engine: its
                    step never returns (a stuck forward, for stepTimeoutSeconds)
  accepts           the content part kinds it declares it reads (default: text, image, audio,
                    video: it stands in for any model, and reads only the text)
  voices            the voices an audio stage speaks in, its default first (default: alloy,
                    echo); each gives other samples
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import zlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import torch

from omni_pipeline.payloads import Audio, Tokens
from omni_pipeline.sampling import params
from omni_pipeline.spec import OutputKind, StageSpec
from omni_stage.engines.base import Engine, EngineCall, EngineError
from omni_stage.segments import EngineOutput


def _request_text(inputs: dict[str, Any]) -> str:
    req = inputs.get("request") or {}
    parts = [str(m.get("content", "")) for m in req.get("messages", []) if isinstance(m, dict)]
    return " ".join(parts) + str(req.get("prompt", ""))


@dataclass(slots=True)
class _Emitted:
    """A request's seed (from its first call's inputs) and the units made for it so far."""

    seed: int | None = None
    units: int = 0


class SyntheticEngine(Engine):
    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        a = self.args
        self.units_per_call = a.get("unitsPerCall")
        self.ratio = float(a.get("unitsPerInputUnit", 1.0))
        self.s_per_unit = float(a.get("msPerUnit", 0.0)) / 1000
        self.s_per_call = float(a.get("msPerCall", 0.0)) / 1000
        self.hidden = int(a.get("hiddenSize", 0))
        self.samples = int(a.get("samplesPerUnit", 240))
        self.sample_rate = int(a.get("sampleRate", 24000))
        self.fail_on = a.get("failOn")
        self.hang_on = a.get("hangOn")
        self._steps: dict[int, float] = {}
        """Start of each simulated step running now, by a number of its own."""
        self._step_numbers = itertools.count()
        self.audio = stage.final_output is OutputKind.AUDIO
        self.accepts = frozenset(a.get("accepts", ("text", "image", "audio", "video")))
        if self.audio:
            self.voices = tuple(a.get("voices", ("alloy", "echo")))
            self.request_keys = params("voice")

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        text = _request_text(call.inputs)
        if self.fail_on and self.fail_on in text:
            raise EngineError(f"poisoned input ({self.fail_on!r})")
        if self.hang_on and self.hang_on in text:
            await self._step(asyncio.Event().wait())  # never set
        if "request" in call.inputs:
            n = int(self.units_per_call or call.sampling.max_tokens or 16)
        else:
            n_in = sum(_units(p) for p in call.inputs.values())
            n = math.ceil(n_in * self.ratio)
        st = call.kept(_Emitted)
        if st.seed is None:
            st.seed = _seed(call.inputs, text)
        seed = st.seed
        voice = self.voices.index(self.voice(call.sampling)) if self.voices else 0
        start = st.units
        if self.s_per_call:
            await self._step(asyncio.sleep(self.s_per_call))
        for i in range(start, start + n):
            if self.s_per_unit:
                await self._step(asyncio.sleep(self.s_per_unit))
            tok = (seed + i) % 1000
            if self.audio:  # for audio, a unit is one sample
                audio = Audio(
                    audio=torch.full((self.samples,), ((tok + 37 * voice) % 100) / 100.0),
                    sample_rate=self.sample_rate,
                )
                yield EngineOutput(units=self.samples, data=audio)
                continue
            data = Tokens(token_ids=torch.tensor([tok], dtype=torch.int64))
            if self.hidden:
                data["hidden_states"] = torch.full((1, self.hidden), float(tok % 7), dtype=torch.float32)
            yield EngineOutput(units=1, text=f"tok{i} ", data=data)
        st.units = start + n

    async def _step(self, work: Awaitable[object]) -> None:
        n = next(self._step_numbers)
        self._steps[n] = time.monotonic()
        try:
            await work
        finally:
            del self._steps[n]

    def busy_s(self) -> float | None:
        return time.monotonic() - min(self._steps.values()) if self._steps else None


def _seed(inputs: dict[str, Any], text: str) -> int:
    """What a request's outputs follow from: its text at a source stage, the first token it is
    fed elsewhere. Not its id: a request run again (a migration) gives the same outputs."""
    if "request" in inputs:
        return zlib.crc32(text.encode())
    for p in inputs.values():
        if isinstance(ids := p.get("token_ids"), torch.Tensor) and ids.numel():
            return int(ids.reshape(-1)[0])
    return 0


def _units(p: dict[str, Any]) -> int:
    for v in p.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
        if isinstance(v, list):
            return len(v)
    return 0
