"""Diffusion stages with diffusers: a denoiser that samples latents, a VAE that decodes them
(seed 000 section 4: D0 plan, D1 sampling loop with previews, D2 decode).

`engine.model` is a diffusers pipeline directory; its `model_index.json` names each part's
class, and a stage loads only the parts its `role` needs, each with diffusers' own
`from_pretrained(path, subfolder=part)`. The text encoder is not one of them: it is the
upstream text stage (the transformers engine with `mode: encode`), as Qwen-Image conditions
its transformer on a Qwen2 language model's hidden states.

role `denoise` (transformer or UNet, and the scheduler). Reads `prompt_embeds` and, if given,
`negative_prompt_embeds` from upstream. Each scheduler step is one call on the engine's compute
thread, so cancelling the request stops the loop after the step in progress. Emits the final
latents and, when the request asks for previews, the latents every k steps. The steps of
concurrent requests with latents of one size run as one denoiser forward, each row at its own
timestep, prompts padded to the longest and masked; each request's scheduler then steps its
own rows.
role `decode` (the VAE). Latents in, RGB images out. A preview is decoded from 2x downsampled
latents and scaled back to the full size; when several previews wait, only the newest is
decoded. The final image is decoded at full resolution. Concurrent requests' latents of one
size (and kind: preview or final) are decoded as one batch.

Every output is one unit, and its tensors carry a leading unit dimension:
`latents` [1, n, C, h, w] or `images` uint8 [1, n, H, W, 3], with `step` [1] and `final` [1].
So segments and windows may join outputs and still keep them apart.

Request parameters: n, width, height, num_inference_steps, guidance_scale, seed, previews,
partial_images. Arguments (`engine.args`): role, device, dtype, threads, width, height (the
default size), maxSize, steps, guidanceScale, previewEvery, maxBatch.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any, Final, NamedTuple

import torch
import torch.nn.functional as F

from omni_pipeline.clips import ClipError, check_size
from omni_pipeline.payloads import Images
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest, seeded
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.diffusers.parts import (
    DiffusersPart,
    SamplingState,
    VaeDecoder,
    conditioning,
    denormalized,
    inputs_of,
    is_wan_vae,
    latents_unit,
    pixels,
)
from omni_stage.payload import Payload
from omni_stage.segments import EngineOutput

_DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DENOISERS: Final = ("PixArtTransformer2DModel", "UNet2DConditionModel")
"""Denoiser classes whose call this engine knows (text-conditioned, cross-attention)."""
MAX_IMAGES: Final = 10
MAX_STEPS: Final = 1000


class DenoiserRows(NamedTuple):
    """One denoiser forward's inputs, over the rows of several requests: latents `x` at
    timesteps `t` (one per row), the text states `cond` and their `mask`, each row's (height,
    width)."""

    x: torch.Tensor
    t: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    sizes: list[tuple[int, int]]


class DenoiseEngine(DiffusersPart):
    weights = ("denoiser",)
    request_keys = params(
        "n", "width", "height", "num_inference_steps", "guidance_scale", "seed", "previews", "partial_images"
    )

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        a = self.args
        self.width = int(a.get("width", 512))
        self.height = int(a.get("height", 512))
        self.max_size = int(a.get("maxSize", 1024))
        self.steps = int(a.get("steps", 20))
        self.guidance = float(a.get("guidanceScale", 4.5))
        self.preview_every = max(1, int(a.get("previewEvery", 5)))
        self.denoiser: Any = None
        self.scheduler: Any = None
        self.multiple = 8
        self._takes_generator = False
        self.batcher = StepBatcher(self._steps_together, self._compute, self.max_batch)

    def _load(self) -> None:
        part = "transformer" if self._has_part("transformer") else "unet"
        cls = self._load_denoiser(part, _DENOISERS, "denoiser")
        self._takes_generator = "generator" in inspect.signature(self.scheduler.step).parameters
        c = self.denoiser.config
        cells = c.patch_size if cls == "PixArtTransformer2DModel" else 2 ** (len(c.block_out_channels) - 1)
        self.multiple = self.vae_scale * int(cells)

    def _load_denoiser(self, part: str, supported: tuple[str, ...], kind: str) -> str:
        """Loads the denoiser (`part`, of a class this engine knows) and the scheduler; the
        denoiser's class name."""
        cls = str(self._part_class(part).__name__)
        if cls not in supported:
            raise EngineError(
                f"stage '{self.stage.name}': {kind} {cls} is not supported; supported: {', '.join(supported)}"
            )
        self.denoiser = self._load_part(part)
        self.scheduler = self._load_part("scheduler")
        return cls

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        embeds = inputs_of(call, "prompt_embeds")
        if embeds is None:
            raise EngineError(
                f"stage '{self.stage.name}': no prompt_embeds in its inputs (a text stage with mode: encode?)"
            )
        negative = inputs_of(call, "negative_prompt_embeds")
        plan = await self._run(
            self._plan, embeds[-1], None if negative is None else negative[-1], call.sampling
        )
        self._active.add(call.request_id)
        try:
            timesteps = plan.scheduler.timesteps
            for i in range(len(timesteps)):
                await self.batcher.submit(tuple(plan.latents.shape[1:]), (plan, timesteps[i]))
                if i + 1 in plan.previews:
                    yield EngineOutput(units=1, data=latents_unit(plan.latents, i + 1, final=False))
            yield EngineOutput(units=1, data=latents_unit(plan.latents, len(timesteps), final=True))
        finally:
            self._active.discard(call.request_id)

    def _params(self, sampling: Sampling) -> tuple[int, int, int, int, float]:
        n = sampling.n or 1
        width = sampling.width or self.width
        height = sampling.height or self.height
        steps = sampling.num_inference_steps or self.steps
        guidance = self.guidance if sampling.guidance_scale is None else sampling.guidance_scale
        try:
            check_size(width, height, self.multiple, self.max_size)
        except ClipError as exc:
            raise InvalidRequest(str(exc)) from None
        if not 1 <= n <= MAX_IMAGES:
            raise InvalidRequest(f"n: {n} images; from 1 to {MAX_IMAGES}")
        if not 1 <= steps <= MAX_STEPS:
            raise InvalidRequest(f"num_inference_steps: {steps}; from 1 to {MAX_STEPS}")
        if guidance < 0:
            raise InvalidRequest(f"guidance_scale: {guidance}; must not be negative")
        return n, width, height, steps, guidance

    def _preview_steps(self, steps: int, sampling: Sampling) -> set[int]:
        """After which steps a preview goes out: every k steps, or `partial_images` spread evenly."""
        if not sampling.previews:
            return set()
        partial = sampling.partial_images
        if partial is None:
            return set(range(self.preview_every, steps, self.preview_every))
        every = steps / (partial + 1)
        return {s for i in range(partial) if 0 < (s := round(every * (i + 1))) < steps}

    def _begin(self, embeds: torch.Tensor, wants: int, sampling: Sampling) -> tuple[torch.Generator, Any]:
        """How every plan of a request starts: its prompt embeddings' width checked against what
        the denoiser takes (`wants`), its generator (its seed's), and a scheduler of its own (a
        scheduler's state is per request), its timesteps not yet set."""
        if embeds.shape[-1] != wants:
            raise EngineError(
                f"stage '{self.stage.name}': prompt embeddings are {embeds.shape[-1]} wide, "
                f"the denoiser takes {wants}"
            )
        return seeded(sampling.seed), type(self.scheduler).from_config(self.scheduler.config)

    def _conditioning(
        self, embeds: torch.Tensor, negative: torch.Tensor | None, n: int, cfg: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`conditioning`'s states and mask, on the stage's device in its dtype."""
        cond, mask = conditioning(embeds, negative, n, cfg)
        return cond.to(self.device, self.dtype), mask.to(self.device, self.dtype)

    @torch.inference_mode()
    def _plan(self, embeds: torch.Tensor, negative: torch.Tensor | None, sampling: Sampling) -> SamplingState:
        n, width, height, steps, guidance = self._params(sampling)
        c = self.denoiser.config
        wants = c.caption_channels if hasattr(c, "caption_channels") else c.cross_attention_dim
        generator, scheduler = self._begin(embeds, wants, sampling)
        scheduler.set_timesteps(steps, device=self.device)
        shape = (n, c.in_channels, height // self.vae_scale, width // self.vae_scale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        latents = (latents * scheduler.init_noise_sigma).to(self.device, self.dtype)
        cond, mask = self._conditioning(embeds, negative, n, guidance > 1.0)
        previews = self._preview_steps(steps, sampling)
        return SamplingState(scheduler, latents, cond, mask, guidance, generator, previews, (height, width))

    @torch.inference_mode()
    def _steps_together(self, steps: list[tuple[SamplingState, torch.Tensor]]) -> list[None]:
        """One scheduler step for each request: one denoiser forward over all their rows (with
        guidance, a request's rows are its negative's and its prompt's), then each request's
        scheduler on its own rows."""
        xs = [
            s.scheduler.scale_model_input(torch.cat([s.latents] * 2) if s.cfg else s.latents, t)
            for s, t in steps
        ]
        rows = [x.shape[0] for x in xs]
        length = max(s.cond.shape[1] for s, _ in steps)
        out = self._denoise(
            DenoiserRows(
                torch.cat(xs),
                torch.cat([t.reshape(1).expand(n) for (_, t), n in zip(steps, rows, strict=True)]),
                torch.cat([F.pad(s.cond, (0, 0, 0, length - s.cond.shape[1])) for s, _ in steps]),
                torch.cat([F.pad(s.mask, (0, length - s.mask.shape[1])) for s, _ in steps]),
                [s.size for (s, _), n in zip(steps, rows, strict=True) for _ in range(n)],
            )
        )
        for (s, t), o in zip(steps, out.split(rows), strict=True):
            if o.shape[1] == 2 * s.latents.shape[1]:  # a learned variance rides along; drop it
                o = o.chunk(2, dim=1)[0]
            if s.cfg:
                uncond, cond = o.chunk(2)
                o = uncond + s.guidance * (cond - uncond)
            extra = {"generator": s.generator} if self._takes_generator else {}
            s.latents = s.scheduler.step(o, t, s.latents, return_dict=False, **extra)[0]
            self._steps += 1
        return [None] * len(steps)

    def _denoise(self, rows: DenoiserRows) -> torch.Tensor:
        """The denoiser on `rows`."""
        x, t, cond, mask, sizes = rows
        if type(self.denoiser).__name__ == "UNet2DConditionModel":
            return self.denoiser(
                x, t, encoder_hidden_states=cond, encoder_attention_mask=mask, return_dict=False
            )[0]
        added: dict[str, Any] = {"resolution": None, "aspect_ratio": None}
        if getattr(self.denoiser, "use_additional_conditions", False):
            added = {
                "resolution": torch.tensor([[h, w] for h, w in sizes], dtype=self.dtype, device=self.device),
                "aspect_ratio": torch.tensor(
                    [[h / w] for h, w in sizes], dtype=self.dtype, device=self.device
                ),
            }
        return self.denoiser(
            x,
            encoder_hidden_states=cond,
            encoder_attention_mask=mask,
            timestep=t,
            added_cond_kwargs=added,
            return_dict=False,
        )[0]


class DecodeEngine(VaeDecoder):
    """Images: the final one decoded whole; of previews waiting, only the newest, from 2x
    downsampled latents scaled back to the full size."""

    async def _outputs(self, latents: Payload) -> AsyncIterator[EngineOutput]:
        steps, final = latents["step"], latents["final"]
        finals = [i for i in range(len(final)) if bool(final[i])]
        for i in finals or [len(final) - 1]:  # the final image, else only the newest preview
            images = await self.decoded(latents["latents"][i], preview=not bool(final[i]))
            yield EngineOutput(
                units=1,
                data=Images(images=images[None], step=steps[i : i + 1], final=final[i : i + 1]),
            )

    @torch.inference_mode()
    def _decode(self, latents: torch.Tensor, preview: bool) -> torch.Tensor:
        lat = denormalized(latents.to(self.device, self.dtype), self.vae)
        size = (lat.shape[-2] * self.vae_scale, lat.shape[-1] * self.vae_scale)
        if preview and min(lat.shape[-2:]) >= 2:
            lat = F.avg_pool2d(lat, 2)
        if is_wan_vae(self.vae):  # a video VAE (Qwen-Image's): one frame
            image = self.vae.decode(lat[:, :, None], return_dict=False)[0][:, :, 0]
        else:
            image = self.vae.decode(lat, return_dict=False)[0]
        if tuple(image.shape[-2:]) != size:
            image = F.interpolate(image.float(), size=size, mode="bilinear", align_corners=False)
        return pixels(image)
