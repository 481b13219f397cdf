"""What the diffusers stages share: loading a pipeline directory's parts by its
`model_index.json` (`DiffusersPart`), a request's sampling state, the VAE decoder the image and
video decode stages are, and the conditioning and latent helpers of every family.

`engine.model` is a diffusers pipeline directory; its `model_index.json` names each part's class,
and a stage loads only the parts its `role` needs, each with diffusers' own
`from_pretrained(path, subfolder=part)`.
"""

from __future__ import annotations

import functools
import json
from abc import abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F

from omni_pipeline.payloads import Latents, gather
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import ComputeEngine, EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.payload import Payload, concat
from omni_stage.segments import EngineOutput

_DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DiffusersPart(ComputeEngine):
    """Loading by `model_index.json`."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        dtype = self.args.get("dtype", "float32")
        if dtype not in _DTYPES:
            raise EngineError(f"stage '{stage.name}': engine.args.dtype must be one of {sorted(_DTYPES)}")
        self.dtype = _DTYPES[dtype]
        self.path = Path(str(stage.engine.model))
        self._active: set[str] = set()
        self._steps = 0
        self.vae_scale = 8
        """Pixels per latent cell, from the VAE's config (the denoiser never loads the VAE)."""
        self.vae_frames = 1
        """Video frames per latent frame after the first (a video VAE's temporal compression)."""

    async def start(self) -> None:
        await self._load_alone(self._start)

    def _start(self) -> None:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()  # a server's log is not a terminal
        if threads := self.args.get("threads"):
            torch.set_num_threads(int(threads))
        config = self._part_class("vae").load_config(self.path, subfolder="vae")
        self.vae_scale = int(config.get("scale_factor_spatial") or _spatial_scale(config))
        self.vae_frames = int(config.get("scale_factor_temporal") or 1)
        self._load()

    @functools.cached_property
    def _index(self) -> dict[str, Any]:
        """The pipeline directory's model_index.json: which class each part is."""
        index_file = self.path / "model_index.json"
        try:
            index = json.loads(index_file.read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"stage '{self.stage.name}': cannot read {index_file}: {exc}") from exc
        if not isinstance(index, dict):
            raise EngineError(f"stage '{self.stage.name}': {index_file} is not a diffusers model index")
        return index

    def _part_class(self, part: str) -> Any:
        """The class of a part, from diffusers or (a text encoder, a tokenizer) transformers."""
        import diffusers
        import transformers

        index_file = self.path / "model_index.json"
        entry = self._index.get(part)
        libraries = {"diffusers": diffusers, "transformers": transformers}
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in libraries:
            raise EngineError(f"stage '{self.stage.name}': {index_file} has no diffusers part '{part}'")
        cls = getattr(libraries[entry[0]], str(entry[1]), None)
        if cls is None:
            raise EngineError(
                f"stage '{self.stage.name}': {entry[0]} has no class {entry[1]!r} (for '{part}')"
            )
        return cls

    def _has_part(self, part: str) -> bool:
        try:
            self._part_class(part)
        except EngineError:
            return False
        return True

    def _load_part(self, part: str) -> Any:
        cls = self._part_class(part)
        try:
            if hasattr(cls, "set_timesteps"):  # a scheduler: a config, no weights
                return cls.from_pretrained(self.path, subfolder=part)
            return (
                cls.from_pretrained(self.path, subfolder=part, torch_dtype=self.dtype).to(self.device).eval()
            )
        except (OSError, ValueError) as exc:
            raise EngineError(
                f"stage '{self.stage.name}': cannot load '{part}' from {self.path}: {exc}"
            ) from exc

    def active_requests(self) -> int:
        return len(self._active)

    def steps_run(self) -> int:
        return self._steps


@dataclass
class SamplingState:
    """One request's state in the sampling loop (D0's plan, advanced by D1's steps)."""

    scheduler: Any
    latents: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    guidance: float
    generator: torch.Generator
    previews: set[int]
    size: tuple[int, int]
    """(height, width) in pixels."""

    @property
    def cfg(self) -> bool:
        return self.guidance > 1.0


class VaeDecoder(DiffusersPart):
    """A VAE decoding the denoiser's latents into uint8 pixels, concurrent requests' latents of
    one shape (and kind: preview or final) in one decode. The image and video decode stages are
    one each; they differ in what they decode and what they pass on."""

    weights = ("vae",)

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.vae: Any = None
        self.batcher = StepBatcher(self._decode_together, self._compute, self.max_batch)

    def _load(self) -> None:
        self.vae = self._load_part("vae")

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        parts = [p for p in call.inputs.values() if "latents" in p]  # a Latents payload each
        if not parts:
            return
        self._active.add(call.request_id)
        try:
            async for out in self._outputs(concat(parts)):
                yield out
        finally:
            self._active.discard(call.request_id)

    @abstractmethod
    def _outputs(self, latents: Payload) -> AsyncIterator[EngineOutput]:
        """What the stage passes on for the units of latents that came: `latents`, `step`,
        `final` per unit (and what the denoiser adds)."""

    async def decoded(self, latents: torch.Tensor, preview: bool = False) -> torch.Tensor:
        """One request's latents [n, C, ...] decoded, batched with other requests' alike."""
        return await self.batcher.submit((tuple(latents.shape[1:]), preview), (latents, preview))

    def _decode_together(self, items: list[tuple[torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Latents of one shape and kind from several requests, in one VAE decode."""
        decoded = self._decode(torch.cat([latents for latents, _ in items]), items[0][1])
        self._steps += 1
        return list(decoded.split([latents.shape[0] for latents, _ in items]))

    @abstractmethod
    def _decode(self, latents: torch.Tensor, preview: bool) -> torch.Tensor:
        """Latents [n, C, ...] as uint8 pixels, channels last (`pixels`)."""


def pixels(decoded: torch.Tensor) -> torch.Tensor:
    """A VAE's output [n, 3, ...] in [-1, 1] as uint8 [n, ..., 3] on the CPU."""
    rgb = ((decoded.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return rgb.movedim(1, -1).cpu().contiguous()


def is_wan_vae(vae: Any) -> bool:
    """Wan's causal 3D VAE or one of its kind (Qwen-Image's): latents [n, C, frames, h, w],
    normalized per channel."""
    return (
        getattr(vae.config, "z_dim", None) is not None
        and getattr(vae.config, "latents_mean", None) is not None
    )


def denormalized(latents: torch.Tensor, vae: Any) -> torch.Tensor:
    """Latents [n, C, ...] as the VAE decodes them: by its per-channel mean and std (Wan's and
    Qwen-Image's VAEs), else by its scaling and shift factors."""
    c = vae.config
    if is_wan_vae(vae):
        shape = (1, c.z_dim) + (1,) * (latents.dim() - 2)
        mean = torch.tensor(c.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(c.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / std + mean
    return latents / c.scaling_factor + (getattr(c, "shift_factor", None) or 0.0)


def _spatial_scale(vae: dict[str, Any]) -> int:
    """Pixels per latent cell of a VAE's config: one halving per down block after the first, or
    (Wan's and Qwen-Image's VAEs) per entry of its `temperal_downsample`."""
    if "temperal_downsample" in vae:
        return 2 ** len(vae["temperal_downsample"])
    return 2 ** (len(vae["block_out_channels"]) - 1)


def inputs_of(call: EngineCall, key: str) -> torch.Tensor | None:
    """The tensors of `key` (a key of `PromptEmbeds`) the producers sent, joined."""
    found = [v for v in gather(call.inputs, key) if isinstance(v, torch.Tensor)]
    return torch.cat(found) if found else None


def conditioning(
    embeds: torch.Tensor, negative: torch.Tensor | None, n: int, cfg: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention inputs for a batch of n: with guidance, the negative (or a null embedding)
    and the prompt, padded to one length, the padding masked out."""
    embeds = embeds.float()
    if not cfg:
        return embeds.expand(n, -1, -1), torch.ones(n, embeds.shape[0])
    neg = negative.float() if negative is not None else torch.zeros(1, embeds.shape[-1])
    length = max(embeds.shape[0], neg.shape[0])

    def padded(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.zeros(length)
        mask[: e.shape[0]] = 1
        return F.pad(e, (0, 0, 0, length - e.shape[0])), mask

    (ne, nm), (pe, pm) = padded(neg), padded(embeds)
    cond = torch.cat([ne.expand(n, -1, -1), pe.expand(n, -1, -1)])
    mask = torch.cat([nm.expand(n, -1), pm.expand(n, -1)])
    return cond, mask


def latents_unit(latents: torch.Tensor, step: int, final: bool) -> Latents:
    return Latents(
        latents=latents.float().cpu().clone()[None],
        step=torch.tensor([step], dtype=torch.int64),
        final=torch.tensor([final], dtype=torch.bool),
    )
