"""Image editing stages: Qwen-Image-Edit as diffusers' `QwenImageEditPipeline` computes it, cut
at its two seams (the conditioning, the sampling loop); the VAE decode is image.py's.

role `encode` (`Qwen2_5_VLForConditionalGeneration` with its processor, and the VAE's encoder).
Reads the client's prompt, its negative and the one image to edit (`images`: references into
the request's media, RGB uint8 [H, W, 3] as the gateway decoded it). As the pipeline does, it
resizes the image to about a megapixel at its aspect ratio, lets the vision-language model
read the instruction with that image (the template's first tokens dropped), and encodes the
image into normalized VAE latents. Out: `prompt_embeds` [1, tokens, hidden],
`negative_prompt_embeds` (only with a negative prompt: the pipeline guides only then),
`image_latents` [1, C, 1, h, w], `image_size` [2] (the input's height and width).
role `denoise` (`QwenImageTransformer2DModel`, the flow-matching scheduler). The packed noise
and the packed image latents go into the transformer as one sequence, the prediction for the
noise's part kept; with a negative and `guidance_scale` > 1, the pipeline's true guidance with
its norm rescaling. The output is the input's size (scaled down into `maxSize`, rounded down
to the model's multiple) unless the request sets one. Latents go out unpacked, [1, n, C, h, w],
for image.py's decoder, which also makes the previews of a stream.

The pipeline's own code does what it can: its prompt encoder, its VAE encoder, its resizing and
latent packing are called on a pipeline object holding only the stage's parts, so the
conditioning is diffusers' by construction; the loop is ours (steps of concurrent requests in
one forward, a cancelled request stopping after the step in progress).

Request parameters: those of image.py's denoiser. Arguments (`engine.args`): role, device,
dtype, threads, maxSize, steps, guidanceScale (4.0, the pipeline's `true_cfg_scale`),
previewEvery, maxBatch.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final, cast

import numpy as np
import torch
import torch.nn.functional as F

from omni_pipeline.payloads import PromptEmbeds
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest
from omni_stage.engines.diffusers.image import DenoiseEngine
from omni_stage.engines.diffusers.parts import DiffusersPart, SamplingState, inputs_of, latents_unit
from omni_stage.segments import EngineOutput

EDIT_DENOISERS: Final = ("QwenImageTransformer2DModel",)
CONDITION_AREA: Final = 1024 * 1024
"""The pixels the pipeline resizes the input image to (at its aspect ratio) before reading it."""


def edit_pipeline(parts: dict[str, Any]) -> Any:
    """diffusers' QwenImageEditPipeline holding `parts` (the others None): its methods are the
    family's conditioning code."""
    from diffusers import QwenImageEditPipeline

    every = ("scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer")
    return QwenImageEditPipeline(**{name: parts.get(name) for name in every})


def _pipeline_class() -> Any:
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline


class EditEncodeEngine(DiffusersPart):
    weights = ("text_encoder", "vae")
    accepts = frozenset({"text", "image"})

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.pipe: Any = None

    def _load(self) -> None:
        parts = {"text_encoder": self._load_part("text_encoder"), "vae": self._load_part("vae")}
        for name in ("tokenizer", "processor"):
            try:
                parts[name] = self._part_class(name).from_pretrained(self.path, subfolder=name)
            except (OSError, ValueError) as exc:
                raise EngineError(
                    f"stage '{self.stage.name}': cannot load '{name}' from {self.path}: {exc}"
                ) from exc
        self.pipe = edit_pipeline(parts)

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request")
        if request is None or not isinstance(request.get("prompt"), str):
            raise EngineError(f"stage '{self.stage.name}': role encode reads a client request's prompt")
        media: dict[str, torch.Tensor] = request.get("media") or {}
        images = [media.get(ref) for ref in request.get("images") or []]
        if len(images) != 1 or not isinstance(images[0], torch.Tensor):
            raise InvalidRequest(f"image: this model edits one image at a time; {len(images)} given")
        negative = request.get("negative_prompt")
        self._active.add(call.request_id)
        try:
            data, tokens = await self._run(self._encode, str(request["prompt"]), negative, images[0])
        finally:
            self._active.discard(call.request_id)
        call.state.prompt_tokens = tokens
        yield EngineOutput(units=1, data=data)

    @torch.inference_mode()
    def _encode(self, prompt: str, negative: str | None, rgb: torch.Tensor) -> tuple[dict[str, Any], int]:
        """The pipeline's conditioning of one request, and the prompt's token count."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
        from PIL import Image

        image = Image.fromarray(rgb.numpy(), "RGB")
        width, height, _ = calculate_dimensions(CONDITION_AREA, image.width / image.height)
        shown = self.pipe.image_processor.resize(image, height, width)
        pixels = self.pipe.image_processor.preprocess(shown, height, width).unsqueeze(2)
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
        embeds, mask = self.pipe._get_qwen_prompt_embeds(prompt, shown, self.device, self.dtype)
        data = PromptEmbeds(
            prompt_embeds=embeds.float().cpu(),
            image_latents=latents.float().cpu(),
            image_size=torch.tensor([rgb.shape[0], rgb.shape[1]], dtype=torch.int64),
        )
        if negative is not None:
            neg, _ = self.pipe._get_qwen_prompt_embeds(negative, shown, self.device, self.dtype)
            data["negative_prompt_embeds"] = neg.float().cpu()
        self._steps += 1
        return data, int(mask.sum())


@dataclass
class EditState(SamplingState):
    """A request in the loop: its packed noise latents, and the packed image latents that ride
    beside them (`cond`: the prompt's rows, then the negative's under guidance)."""

    image: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    shapes: tuple[tuple[int, int, int], ...] = ()
    """The transformer's `img_shapes` of one row: the noise's patches, then the image's."""


class EditDenoiseEngine(DenoiseEngine):
    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.guidance = float(self.args.get("guidanceScale", 4.0))

    def _load(self) -> None:
        self._load_denoiser("transformer", EDIT_DENOISERS, "editing denoiser")
        if self.denoiser.config.guidance_embeds:
            raise EngineError(f"stage '{self.stage.name}': guidance-distilled transformers are not supported")
        self.multiple = self.vae_scale * int(self.denoiser.config.patch_size)

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        embeds = inputs_of(call, "prompt_embeds")
        image = inputs_of(call, "image_latents")
        size = inputs_of(call, "image_size")
        if embeds is None or image is None or size is None:
            raise EngineError(
                f"stage '{self.stage.name}': no prompt_embeds and image_latents in its inputs "
                f"(an encode stage of an editing pipeline?)"
            )
        negative = inputs_of(call, "negative_prompt_embeds")
        sampling = call.sampling.over(self._default_size(int(size[-2]), int(size[-1])))
        plan = await self._run(
            self._plan_edit, embeds[-1], None if negative is None else negative[-1], image[-1:], sampling
        )
        self._active.add(call.request_id)
        try:
            timesteps = plan.scheduler.timesteps
            key = (tuple(plan.latents.shape), tuple(plan.image.shape))
            for i in range(len(timesteps)):
                await self.batcher.submit(key, (plan, timesteps[i]))
                if i + 1 in plan.previews:
                    yield EngineOutput(units=1, data=latents_unit(self._unpacked(plan), i + 1, final=False))
            yield EngineOutput(units=1, data=latents_unit(self._unpacked(plan), len(timesteps), final=True))
        finally:
            self._active.discard(call.request_id)

    def _default_size(self, height: int, width: int) -> Sampling:
        """The input's size, scaled down into maxSize and rounded down to the model's multiple."""
        scale = min(1.0, self.max_size / max(height, width))
        m = self.multiple
        return Sampling(
            width=max(m, math.floor(width * scale) // m * m),
            height=max(m, math.floor(height * scale) // m * m),
        )

    @torch.inference_mode()
    def _plan_edit(
        self,
        embeds: torch.Tensor,
        negative: torch.Tensor | None,
        image: torch.Tensor,
        sampling: Sampling,
    ) -> EditState:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift, retrieve_timesteps

        n, width, height, steps, guidance = self._params(sampling)
        generator, scheduler = self._begin(embeds, self.denoiser.config.joint_attention_dim, sampling)
        pack = _pipeline_class()._pack_latents
        channels = self.denoiser.config.in_channels // 4
        h, w = 2 * (height // self.multiple), 2 * (width // self.multiple)
        # In the stage's dtype, drawn and stepped, as the pipeline's latents are (its prompt
        # embeddings' dtype): bfloat16 noise is not float32 noise rounded.
        noise = torch.randn((n, 1, channels, h, w), generator=generator, dtype=self.dtype)
        latents = pack(noise, n, channels, h, w).to(self.device)
        ih, iw = image.shape[-2:]
        packed = pack(image.float().expand(n, -1, -1, -1, -1), n, channels, ih, iw).to(
            self.device, self.dtype
        )

        c = scheduler.config
        mu = calculate_shift(
            latents.shape[1],
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)

        cfg = negative is not None and guidance > 1.0
        rows = [embeds.float().expand(n, -1, -1)] + ([negative.float().expand(n, -1, -1)] if cfg else [])
        length = max(r.shape[1] for r in rows)
        cond = torch.cat([F.pad(r, (0, 0, 0, length - r.shape[1])) for r in rows])
        mask = torch.cat([F.pad(torch.ones(n, r.shape[1]), (0, length - r.shape[1])) for r in rows])
        return EditState(
            scheduler,
            latents,
            cond.to(self.device, self.dtype),
            mask.to(self.device),
            guidance if cfg else 1.0,
            generator,
            self._preview_steps(steps, sampling),
            (height, width),
            image=packed,
            shapes=((1, h // 2, w // 2), (1, ih // 2, iw // 2)),
        )

    @torch.inference_mode()
    def _steps_together(self, steps: list[tuple[SamplingState, torch.Tensor]]) -> list[None]:
        """One scheduler step for each request: their rows in one transformer forward (prompts
        padded to the longest and masked; unmasked where none is padded, as the pipeline
        calls it), then the pipeline's guidance and each request's scheduler on its rows."""
        states = [cast(EditState, s) for s, _ in steps]  # this engine plans only EditStates
        rows = [s.cond.shape[0] for s in states]
        x = torch.cat(
            [
                torch.cat([s.latents, s.image], dim=1).to(self.dtype).repeat(r // s.latents.shape[0], 1, 1)
                for s, r in zip(states, rows, strict=True)
            ]
        )
        t = torch.cat([tt.reshape(1).expand(r) for (_, tt), r in zip(steps, rows, strict=True)])
        length = max(s.cond.shape[1] for s in states)
        cond = torch.cat([F.pad(s.cond, (0, 0, 0, length - s.cond.shape[1])) for s in states])
        mask = torch.cat([F.pad(s.mask, (0, length - s.mask.shape[1])) for s in states])
        out = self.denoiser(
            hidden_states=x,
            timestep=t.to(self.dtype) / 1000,  # rounded to the dtype first, as the pipeline does
            encoder_hidden_states=cond,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[list(states[0].shapes)] * x.shape[0],
            return_dict=False,
        )[0]
        for s, (_, tt), o in zip(states, steps, out.split(rows), strict=True):
            o = o[:, : s.latents.shape[1]]
            if s.cfg:
                pred, neg = o.chunk(2)
                combined = neg + s.guidance * (pred - neg)
                o = combined * (
                    torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
                )
            s.latents = s.scheduler.step(o, tt, s.latents, return_dict=False)[0]
            self._steps += 1
        return [None] * len(steps)

    def _unpacked(self, plan: SamplingState) -> torch.Tensor:
        """[n, C, h, w] latents of the packed sequence (the frame axis dropped)."""
        height, width = plan.size
        return _pipeline_class()._unpack_latents(plan.latents, height, width, self.vae_scale)[:, :, 0]
