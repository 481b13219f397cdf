"""Video diffusion stages: Wan 2.1's 3D transformer as the denoiser, its causal 3D VAE as the
decoder (the image stages of image.py, with time as one more latent axis).

role `denoise` (`WanTransformer3DModel`). Reads `prompt_embeds` and `negative_prompt_embeds`
(the `encode` stage's), pads them with zeros to `textLength` tokens as Wan's pipeline feeds its
transformer, and samples latents [n, C, 1 + (frames - 1) / 4, h / 8, w / 8] in float32, the
transformer running in the stage's dtype. The prompt's and the negative's rows go in one
forward, and concurrent requests' steps with latents of one shape share it (image.py's
batching). A clip's length is `num_frames`, or `seconds` at the stage's `fps`, rounded to
the frames the VAE can make (4k + 1); the stage's `maxFrames` bounds it.
role `decode` (`AutoencoderKLWan`). Final latents in, frames out: uint8 [n, F, H, W, 3].

Units. A video job reports its progress, so with `progress` set the denoiser emits a unit after
a step (every step, or at most one per `progressIntervalS`) that carries no latents, only the
count; the final unit carries them. Units joined
in one segment stay aligned, so the latents ride in a per-unit list (`None` in a progress unit):
`latents` [tensor | None], `step` [1], `steps` [1], `final` [1]; metadata `fps`. The decoder
passes the newest progress on and decodes the final unit: `frames` [tensor | None] per unit.

Request parameters: n, width, height, num_frames, seconds, fps, num_inference_steps,
guidance_scale, seed, progress. Arguments (`engine.args`): those of image.py's stages, and
textLength, fps (the clip's frame rate, default 16, Wan's), frames (default length), maxFrames,
progressIntervalS (0.2).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Final

import torch

from omni_pipeline.clips import ClipError, ClipLimits, clip_frames
from omni_pipeline.payloads import Latents, VideoFrames
from omni_pipeline.sampling import Sampling, params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest
from omni_stage.engines.diffusers.image import DenoiseEngine, DenoiserRows
from omni_stage.engines.diffusers.parts import (
    SamplingState,
    VaeDecoder,
    denormalized,
    inputs_of,
    pixels,
)
from omni_stage.engines.diffusers.text import TEXT_LENGTH
from omni_stage.payload import Payload
from omni_stage.segments import EngineOutput

VIDEO_DENOISERS: Final = ("WanTransformer3DModel",)
PROGRESS_INTERVAL_S: Final = 0.2
"""Progress goes out after a step at most this often: a real model's step takes longer (every
step reported), a small one's steps would cost more in messages than in compute."""


class VideoDenoiseEngine(DenoiseEngine):
    request_keys = DenoiseEngine.request_keys | params("num_frames", "seconds", "fps", "progress")

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.text_length = int(self.args.get("textLength", TEXT_LENGTH))
        self.fps = int(self.args.get("fps", 16))
        self.frames = int(self.args.get("frames", 81))
        self.max_frames = int(self.args.get("maxFrames", self.frames))
        self.progress_s = float(self.args.get("progressIntervalS", PROGRESS_INTERVAL_S))

    def _load(self) -> None:
        self._load_denoiser("transformer", VIDEO_DENOISERS, "video denoiser")
        self._takes_generator = False  # flow-matching schedulers draw no noise while stepping
        self.multiple = self.vae_scale * int(self.denoiser.config.patch_size[1])
        self.clip_limits = ClipLimits(
            self.multiple, self.max_size, self.fps, self.frames, self.max_frames, self.vae_frames
        )

    def _frames(self, sampling: Sampling) -> tuple[int, int]:
        """The clip's frames and frame rate (omni_pipeline.clips)."""
        assert self.clip_limits is not None
        try:
            return clip_frames(self.clip_limits, sampling.seconds, sampling.fps, sampling.num_frames)
        except ClipError as exc:
            raise InvalidRequest(str(exc)) from None

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        embeds = inputs_of(call, "prompt_embeds")
        negative = inputs_of(call, "negative_prompt_embeds")
        if embeds is None:
            raise EngineError(f"stage '{self.stage.name}': no prompt_embeds in its inputs (an encode stage?)")
        frames, fps = self._frames(call.sampling)
        plan = await self._run(
            self._plan_video, embeds[-1], None if negative is None else negative[-1], call.sampling, frames
        )
        progress = bool(call.sampling.progress)
        reported = time.monotonic()
        self._active.add(call.request_id)
        try:
            timesteps = plan.scheduler.timesteps
            for i in range(len(timesteps)):
                await self.batcher.submit(tuple(plan.latents.shape[1:]), (plan, timesteps[i]))
                if progress and i + 1 < len(timesteps) and time.monotonic() - reported >= self.progress_s:
                    reported = time.monotonic()
                    yield EngineOutput(units=1, data=_unit(None, i + 1, len(timesteps), fps))
            latents = plan.latents.float().cpu().clone()
            yield EngineOutput(units=1, data=_unit(latents, len(timesteps), len(timesteps), fps))
        finally:
            self._active.discard(call.request_id)

    @torch.inference_mode()
    def _plan_video(
        self, embeds: torch.Tensor, negative: torch.Tensor | None, sampling: Sampling, frames: int
    ) -> SamplingState:
        n, width, height, steps, guidance = self._params(sampling)
        c = self.denoiser.config
        generator, scheduler = self._begin(embeds, c.text_dim, sampling)
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        latent_frames = (frames - 1) // self.vae_frames + 1
        shape = (n, c.in_channels, latent_frames, height // self.vae_scale, width // self.vae_scale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        cond, mask = self._conditioning(self._padded(embeds), self._padded(negative), n, guidance > 1.0)
        return SamplingState(scheduler, latents, cond, mask, guidance, generator, set(), (height, width))

    def _padded(self, embeds: torch.Tensor | None) -> torch.Tensor | None:
        """[tokens, hidden] -> [textLength, hidden], zeros after the prompt (Wan's pipeline)."""
        if embeds is None:
            return None
        e = embeds[: self.text_length].float()
        return torch.cat([e, e.new_zeros(self.text_length - e.shape[0], e.shape[1])])

    def _denoise(self, rows: DenoiserRows) -> torch.Tensor:
        """Wan attends to every text position (the zeros too), so the mask goes unused."""
        out = self.denoiser(
            hidden_states=rows.x.to(self.dtype),
            timestep=rows.t,
            encoder_hidden_states=rows.cond,
            return_dict=False,
        )[0]
        return out.float()


class VideoDecodeEngine(VaeDecoder):
    """Videos: the final latents decoded into frames; progress alone passed on (the newest)."""

    async def _outputs(self, latents: Payload) -> AsyncIterator[EngineOutput]:
        step, steps, final = latents["step"], latents["steps"], latents["final"]
        fps = int(latents.get("fps") or 16)
        done = [i for i in range(len(final)) if bool(final[i])]
        if not done:  # only progress: pass the newest on
            i = len(final) - 1
            yield EngineOutput(units=1, data=_frames_unit(None, int(step[i]), int(steps[i]), False, fps))
            return
        for i in done:
            if not isinstance(unit := latents["latents"][i], torch.Tensor):
                raise EngineError(f"stage '{self.stage.name}': a final unit came without latents")
            video = await self.decoded(unit)
            yield EngineOutput(units=1, data=_frames_unit(video, int(step[i]), int(steps[i]), True, fps))

    @torch.inference_mode()
    def _decode(self, latents: torch.Tensor, preview: bool) -> torch.Tensor:
        """Un-normalized as Wan's pipeline does (per-channel mean and std), decoded, and turned
        into uint8 frames [n, F, H, W, 3]."""
        lat = denormalized(latents.to(self.device, self.dtype), self.vae)
        return pixels(self.vae.decode(lat, return_dict=False)[0])


def _unit(latents: torch.Tensor | None, step: int, steps: int, fps: int) -> Latents:
    return Latents(
        latents=[latents],
        step=torch.tensor([step], dtype=torch.int64),
        steps=torch.tensor([steps], dtype=torch.int64),
        final=torch.tensor([latents is not None], dtype=torch.bool),
        fps=fps,
    )


def _frames_unit(frames: torch.Tensor | None, step: int, steps: int, final: bool, fps: int) -> VideoFrames:
    return VideoFrames(
        frames=[frames],
        step=torch.tensor([step], dtype=torch.int64),
        steps=torch.tensor([steps], dtype=torch.int64),
        final=torch.tensor([final], dtype=torch.bool),
        fps=fps,
    )
