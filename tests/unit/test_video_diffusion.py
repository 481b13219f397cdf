"""Wan 2.1 text-to-video as three diffusers stages driven directly (encode -> denoise ->
decode, chained by hand as the stages of examples/tiny-video.yaml are): the frames equal those
of diffusers' own `WanPipeline` for the same checkpoint (the demo's tiny-video, random
weights), prompt and seed; the progress units a job shows; what a request cannot ask for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_pipeline.clips import ClipLimits
from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import EngineCall, InvalidRequest
from omni_stage.engines.diffusers.video import VideoDenoiseEngine
from omni_stage.payload import concat
from omni_stage.segments import EngineOutput
from tests.unit.test_diffusion import outputs, stage, started


@pytest.fixture(scope="module")
def wan(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-video"


def text_to_video(
    wan: Path, prompt: str, negative: str | None, sampling: dict[str, Any]
) -> tuple[list[EngineOutput], list[EngineOutput]]:
    """The three stages on one request; the denoiser's units and the decoder's."""
    request: dict[str, Any] = {"prompt": prompt}
    if negative is not None:
        request["negative_prompt"] = negative
    [embeds] = outputs(started(stage("encode", wan)), {"request": request}, {})
    latents = outputs(started(stage("denoise", wan, progressIntervalS=0)), {"encoder": embeds.data}, sampling)
    frames = outputs(started(stage("decode", wan)), {"dit": concat([o.data for o in latents])}, {})
    return latents, frames


@pytest.mark.parametrize("negative", [None, "blurry, static"])
def test_wan_matches_the_diffusers_pipeline(wan: Path, negative: str | None) -> None:
    """Exactly: the same float32 computation, the prompt and its negative in one forward here
    and in two there, the zero padding attended to in both."""
    from diffusers import WanPipeline

    prompt = "a fox  runs through &amp; snow"  # cleaned as Wan's pipeline cleans it
    sampling = {"width": 48, "height": 32, "num_frames": 9, "num_inference_steps": 6, "guidance_scale": 5.0}
    _, frames = text_to_video(wan, prompt, negative, {**sampling, "seed": 3})
    [final] = frames
    ours = final.data["frames"][0].numpy()

    ref = WanPipeline.from_pretrained(wan)(
        prompt=prompt,
        negative_prompt=negative,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
        **sampling,
    ).frames
    assert ours.shape == (1, 9, 32, 48, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(np.float32) - np.round(ref * 255)).max() <= 1


def test_a_job_sees_every_step_and_the_decoder_passes_the_newest_on(wan: Path) -> None:
    sampling = {"width": 32, "height": 32, "num_inference_steps": 5, "seed": 1, "progress": True}
    latents, frames = text_to_video(wan, "waves", None, sampling)
    assert [int(o.data["step"][0]) for o in latents] == [1, 2, 3, 4, 5]
    assert [int(o.data["steps"][0]) for o in latents] == [5] * 5
    assert [o.data["latents"][0] is None for o in latents] == [True] * 4 + [False]
    assert [int(o.data["step"][0]) for o in frames] == [5]  # a final among the inputs: only it

    # Progress alone (the decoder behind): only the newest count goes on, and no frames.
    decode = started(stage("decode", wan))
    [progress] = outputs(decode, {"dit": concat([o.data for o in latents[:3]])}, {})
    assert int(progress.data["step"][0]) == 3 and progress.data["frames"] == [None]
    assert not bool(progress.data["final"][0])

    # Without `progress` (a synchronous request): the final latents only.
    latents, _ = text_to_video(wan, "waves", None, {**sampling, "progress": None})
    assert [int(o.data["step"][0]) for o in latents] == [5]


def test_seconds_at_the_frame_rate_make_the_clip(wan: Path) -> None:
    """The demo's stage (fps 8 in examples/tiny-video.yaml; here the engine's default, 16):
    1 s at 8 fps is 9 frames, 4k + 1 as Wan's VAE makes them."""
    engine = started(stage("denoise", wan, width=32, height=32, fps=8, frames=17, maxFrames=33))
    assert isinstance(engine, VideoDenoiseEngine)
    assert engine.clip_limits == ClipLimits(16, 1024, 8, 17, 33, 4)
    assert engine._frames(Sampling(seconds=1.0)) == (9, 8)
    assert engine._frames(Sampling(seconds=2.0, fps=4)) == (9, 4)
    assert engine._frames(Sampling()) == (17, 8)
    assert engine._frames(Sampling(num_frames=5)) == (5, 8)


@pytest.mark.parametrize(
    ("sampling", "says"),
    [
        ({"width": 40}, "size: 40x64: this model makes widths and heights that are multiples of 16"),
        ({"seconds": 10.0}, "seconds: 10; at 16 fps this model makes at most 5 seconds"),
        ({"num_frames": 8}, "num_frames: 8; this model makes 4k \\+ 1 frames"),
        ({"fps": 61}, "fps: 61"),
        ({"num_inference_steps": 1001}, "num_inference_steps"),
    ],
)
def test_what_the_model_cannot_make_is_refused(wan: Path, sampling: dict[str, Any], says: str) -> None:
    engine = started(stage("denoise", wan, width=64, height=64))
    embeds = {"prompt_embeds": torch.randn(1, 3, 32), "negative_prompt_embeds": torch.randn(1, 1, 32)}
    with pytest.raises(InvalidRequest, match=says):
        outputs(engine, {"encoder": embeds}, sampling)


def test_concurrent_requests_step_together_with_the_same_frames(wan: Path) -> None:
    """Three requests at once, two of one shape (they share each denoiser forward) and one of
    another length: each one's latents are what it gets alone, within float32's batched-matmul
    noise grown over the steps."""
    g = torch.Generator().manual_seed(0)
    jobs = [
        ({"prompt_embeds": torch.randn(1, 4, 32, generator=g)}, {"seed": 1}),
        ({"prompt_embeds": torch.randn(1, 6, 32, generator=g)}, {"seed": 2, "guidance_scale": 1.0}),
        ({"prompt_embeds": torch.randn(1, 5, 32, generator=g)}, {"seed": 3, "num_frames": 9}),
    ]
    negative = torch.randn(1, 2, 32, generator=g)

    async def go() -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, int]]:
        denoise = stage("denoise", wan, width=32, height=32, frames=5, maxFrames=9, steps=4, maxBatch=4)
        await denoise.start()

        async def final(embeds: dict[str, torch.Tensor], sampling: dict[str, Any]) -> torch.Tensor:
            inputs = {"encoder": {**embeds, "negative_prompt_embeds": negative}}
            outs = [
                o.data async for o in denoise.generate(EngineCall("r", inputs, True, Sampling.of(sampling)))
            ]
            return outs[-1]["latents"][0]  # type: ignore[no-any-return]

        together = await asyncio.gather(*(final(*job) for job in jobs))
        sizes = denoise.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await final(*job) for job in jobs]
        return list(together), alone, sizes

    together, alone, batches = asyncio.run(go())
    assert max(batches) == 2, batches
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_engines_that_start_together_load_whole(wan: Path) -> None:
    """Four engines of one process loading at once, each on its own compute thread, as a
    replica's tests and a stage's wake-ups can: each loads whole. (transformers builds a model
    on the meta device through module-global state: two loads side by side left parameters on
    meta, "Cannot copy out of meta tensor", until engines took turns to load.)"""

    async def go() -> list[Any]:
        engines = [stage("encode", wan) for _ in range(4)]
        await asyncio.gather(*(e.start() for e in engines))
        return engines

    for engine in asyncio.run(go()):
        assert not any(p.is_meta for p in engine.text_encoder.parameters())  # type: ignore[attr-defined]
