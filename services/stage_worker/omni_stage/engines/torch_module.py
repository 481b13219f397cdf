"""A user's torch module as a stage (vocoders, codecs): `engine.factory: module:function`.

The factory is called with `engine.args` (less the keys this engine reads) and returns an
nn.Module. Each call runs `module(**tensors)` on the edge's payload on the compute thread and
emits the result as one output: under `audio` (with the module's `sample_rate`) when the
stage's final output is audio, else under `outputKey` (default `tensor`). For audio a unit is
a sample; otherwise a unit is a row of the output.

A request's `speed` (text to speech) is passed on as `module(..., speed=x)` to a module whose
`forward` takes it; asked of one that does not, the request is refused. A module with `voices`
(names, its default first) speaks in them: it is called as `module(..., voice=name)`, and any
other voice is refused.

A module that sets `batched = True` takes every input with a leading batch dimension and
returns one output row per batch item. The engine then runs concurrent requests' inputs of
the same shapes (and speed) as one call, up to `maxBatch`; a single request's inputs get a
batch dimension of 1. Any other module is called once per request, as it is written.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from omni_pipeline.sampling import params
from omni_pipeline.spec import OutputKind, StageSpec
from omni_stage.engines.base import ComputeEngine, EngineCall, EngineError, InvalidRequest, import_object
from omni_stage.engines.batching import StepBatcher
from omni_stage.payload import concat
from omni_stage.segments import EngineOutput

_OWN_ARGS = ("device", "threads", "outputKey", "maxBatch")


@dataclass(frozen=True, slots=True)
class _Call:
    """One request's module call."""

    tensors: dict[str, torch.Tensor]
    options: dict[str, Any]

    def shape_key(self) -> Hashable:
        """What calls must share to be stacked into one."""
        shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(self.tensors.items()))
        return shapes, tuple(sorted(self.options.items()))


class TorchModuleEngine(ComputeEngine):
    request_keys = params("speed", "voice")
    weights = ("module",)

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.audio = stage.final_output is OutputKind.AUDIO
        self.output_key = "audio" if self.audio else str(self.args.get("outputKey", "tensor"))
        self.module: Any = None
        self.takes_speed = False
        self.batched = False
        self.batcher = StepBatcher(self._calls, self._compute, self.max_batch)

    async def start(self) -> None:
        await self._load_alone()

    def _load(self) -> None:
        if threads := self.args.get("threads"):
            torch.set_num_threads(int(threads))
        assert self.stage.engine.factory is not None
        factory = import_object(self.stage.engine.factory)
        kwargs = {k: v for k, v in self.args.items() if k not in _OWN_ARGS}
        module = factory(**kwargs)
        if not isinstance(module, torch.nn.Module):
            raise EngineError(
                f"factory {self.stage.engine.factory!r} returned {type(module).__name__}, not a Module"
            )
        self.module = module.to(self.device).eval()
        self.takes_speed = "speed" in inspect.signature(module.forward).parameters
        self.batched = getattr(module, "batched", False) is True
        self.voices = tuple(getattr(module, "voices", ()))

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        payload = concat(list(call.inputs.values()))
        tensors = {k: v.to(self.device) for k, v in payload.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            raise EngineError(f"stage '{self.stage.name}': no tensor inputs")
        options: dict[str, Any] = {}
        if (speed := call.sampling.speed) is not None and speed != 1.0:
            if not self.takes_speed:
                raise InvalidRequest("speed: this pipeline's audio cannot be made faster or slower")
            options["speed"] = float(speed)
        if self.voices:
            options["voice"] = self.voice(call.sampling)
        c = _Call(tensors, options)
        out = await self.batcher.submit(c.shape_key() if self.batched else object(), c)
        data: dict[str, Any] = {self.output_key: out}
        if self.audio and (sr := getattr(self.module, "sample_rate", None)):
            data["sample_rate"] = int(sr)
        yield EngineOutput(units=int(out.shape[0]) if out.dim() else 1, data=data)

    @torch.inference_mode()
    def _calls(self, calls: list[_Call]) -> list[torch.Tensor]:
        if not self.batched:
            return [self._output(self._forward(c.tensors, c.options)) for c in calls]
        stacked = {k: torch.stack([c.tensors[k] for c in calls]) for k in calls[0].tensors}
        out = self._forward(stacked, calls[0].options)
        if out.dim() == 0 or out.shape[0] != len(calls):
            raise EngineError(
                f"stage '{self.stage.name}': a batched module gave {tuple(out.shape)} for {len(calls)} rows"
            )
        return [self._output(row) for row in out.unbind(0)]

    def _forward(self, tensors: dict[str, torch.Tensor], options: dict[str, Any]) -> torch.Tensor:
        try:
            out = self.module(**tensors, **options)
        except TypeError as exc:
            raise EngineError(
                f"stage '{self.stage.name}': module does not take {sorted(tensors)}: {exc}"
            ) from exc
        if not isinstance(out, torch.Tensor):
            raise EngineError(
                f"stage '{self.stage.name}': module returned {type(out).__name__}, not a tensor"
            )
        return out.detach()

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        return out.float().cpu().reshape(-1) if self.audio else out.cpu()
