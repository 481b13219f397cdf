"""The diffusers engine driven directly: its denoise and decode stages, chained by hand, make
exactly the images diffusers' own pipelines make from the same embeddings and seed (PixArt on
the demo model; Stable Diffusion on a tiny UNet written here); the encoder mode of the
transformers engine; previews; what a request cannot ask for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import EngineKind, EngineSpec, InputSpec, StageSpec
from omni_stage.engines.base import Engine, EngineCall, InvalidRequest
from omni_stage.engines.diffusers.image import DenoiseEngine
from omni_stage.engines.registry import build_engine
from omni_stage.payload import concat
from omni_stage.segments import EngineOutput


def stage(role: str, model: Path, **args: Any) -> Engine:
    spec = StageSpec(
        name=role,
        engine=EngineSpec(kind=EngineKind.DIFFUSERS, model=str(model), args={"role": role, **args}),
        inputs=[InputSpec.model_validate({"from": "request"})],
    )
    return build_engine(spec)


def started(engine: Engine) -> Engine:
    asyncio.run(engine.start())
    return engine


def outputs(engine: Engine, inputs: dict[str, Any], sampling: dict[str, Any]) -> list[EngineOutput]:
    async def go() -> list[EngineOutput]:
        return [o async for o in engine.generate(EngineCall("r", inputs, True, Sampling.of(sampling)))]

    return asyncio.run(go())


def text_to_image(
    models: Path, embeds: torch.Tensor, negative: torch.Tensor | None, sampling: dict[str, Any]
) -> tuple[list[EngineOutput], list[EngineOutput]]:
    """Denoise, then decode what it emitted, as the dit and vae stages do."""
    cond: dict[str, Any] = {"prompt_embeds": embeds[None]}
    if negative is not None:
        cond["negative_prompt_embeds"] = negative[None]
    latents = outputs(started(stage("denoise", models, width=32, height=32)), {"encoder": cond}, sampling)
    images = outputs(started(stage("decode", models)), {"dit": concat([o.data for o in latents])}, {})
    return latents, images


@pytest.fixture(scope="module")
def pixart(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-image"


def test_pixart_matches_the_diffusers_pipeline(pixart: Path) -> None:
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    embeds, negative = torch.randn(7, 64), torch.randn(7, 64)
    sampling = {"n": 2, "width": 48, "height": 32, "num_inference_steps": 8, "guidance_scale": 3.0, "seed": 9}
    _, images = text_to_image(pixart, embeds, negative, sampling)
    [final] = images
    ours = final.data["images"][0].numpy()

    pipe = DiffusionPipeline.from_pretrained(pixart, text_encoder=None, tokenizer=None)
    ref = pipe(
        prompt_embeds=embeds[None],
        prompt_attention_mask=torch.ones(1, 7),
        negative_prompt=None,
        negative_prompt_embeds=negative[None],
        negative_prompt_attention_mask=torch.ones(1, 7),
        num_images_per_prompt=2,
        width=48,
        height=32,
        num_inference_steps=8,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(9),
        use_resolution_binning=False,
        output_type="np",
    ).images
    assert ours.shape == (2, 32, 48, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(np.float32) - np.round(ref * 255)).max() <= 1


def tiny_stable_diffusion(path: Path) -> None:
    """A UNet pipeline directory, written as `omni models init-demo` writes the PixArt one."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    torch.manual_seed(4)
    UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=8,
    ).save_pretrained(path / "unet")
    AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
    ).save_pretrained(path / "vae")
    # As Stable Diffusion ships it: its pipeline rewrites older scheduler settings on load.
    DDIMScheduler(steps_offset=1, clip_sample=False).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": [None, None],
        "tokenizer": [None, None],
        "safety_checker": [None, None],
        "feature_extractor": [None, None],
    }
    (path / "model_index.json").write_text(__import__("json").dumps(index))


def test_a_unet_matches_the_stable_diffusion_pipeline(tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    tiny_stable_diffusion(tmp_path)
    torch.manual_seed(1)
    embeds, negative = torch.randn(5, 64), torch.randn(5, 64)
    sampling = {"width": 32, "height": 16, "num_inference_steps": 5, "guidance_scale": 2.0, "seed": 3}
    _, images = text_to_image(tmp_path, embeds, negative, sampling)
    ours = images[0].data["images"][0].numpy()

    pipe = DiffusionPipeline.from_pretrained(
        tmp_path, text_encoder=None, tokenizer=None, safety_checker=None, feature_extractor=None
    )
    ref = pipe(
        prompt_embeds=embeds[None],
        negative_prompt_embeds=negative[None],
        width=32,
        height=16,
        num_inference_steps=5,
        guidance_scale=2.0,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).images
    assert ours.shape == (1, 16, 32, 3)
    assert np.abs(ours.astype(np.float32) - np.round(ref * 255)).max() <= 1


def test_previews_every_k_steps_and_only_the_newest_is_decoded(pixart: Path) -> None:
    embeds = torch.randn(3, 64)
    sampling = {"num_inference_steps": 10, "previews": True, "seed": 1}
    latents, images = text_to_image(pixart, embeds, None, sampling)  # previewEvery 5 by default
    assert [int(o.data["step"][0]) for o in latents] == [5, 10]
    assert [bool(o.data["final"][0]) for o in latents] == [False, True]
    assert [int(o.data["step"][0]) for o in images] == [10]  # a final among the inputs: only it

    # Two previews waiting at once: only the newer one is worth the decode.
    spread = {**sampling, "partial_images": 2, "num_inference_steps": 9}
    latents, _ = text_to_image(pixart, embeds, None, spread)
    previews = concat([o.data for o in latents[:2]])
    assert previews["step"].tolist() == [3, 6]
    [preview] = outputs(started(stage("decode", pixart)), {"dit": previews}, {})
    assert int(preview.data["step"][0]) == 6 and preview.data["images"].shape == (1, 1, 32, 32, 3)


def test_concurrent_requests_denoise_and_decode_in_batches_with_the_same_images(pixart: Path) -> None:
    """Four requests on one denoise and one decode replica at once: prompts of three lengths,
    with and without guidance (and a negative prompt), 1 or 2 images, 6 or 8 steps, and one of
    another size. The three of one size step together (one denoiser forward, each row at its
    own timestep, prompts padded and masked); decoded at once, the two of them that queue
    behind the first go together, the one of another size alone. Each
    request's latents are what it gets alone within 1e-4, relative (float32 sums in another
    order in a batched matmul, about 1e-6, grown over the steps), its pixels within 1 (a pixel
    is rounded)."""
    g = torch.Generator().manual_seed(0)
    jobs = [
        (torch.randn(3, 64, generator=g), None, {"guidance_scale": 1.0, "seed": 1}),
        (torch.randn(7, 64, generator=g), torch.randn(5, 64, generator=g), {"n": 2, "guidance_scale": 3.0}),
        (torch.randn(5, 64, generator=g), None, {"num_inference_steps": 6, "seed": 3}),
        (torch.randn(4, 64, generator=g), None, {"width": 48, "seed": 4}),
    ]

    async def go() -> tuple[list[Any], list[Any], Any, Any]:
        denoise = stage("denoise", pixart, width=32, height=32, steps=8, maxBatch=4)
        decode = stage("decode", pixart, maxBatch=4)
        await denoise.start()
        await decode.start()

        async def denoised(
            embeds: torch.Tensor, negative: torch.Tensor | None, sampling: dict[str, Any]
        ) -> Any:
            cond = {"prompt_embeds": embeds[None]}
            if negative is not None:
                cond["negative_prompt_embeds"] = negative[None]
            call = EngineCall("r", {"encoder": cond}, True, Sampling.of({"seed": 2, **sampling}))
            [final] = [o.data async for o in denoise.generate(call)]
            return final

        async def decoded(final: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            [image] = [
                o.data async for o in decode.generate(EngineCall("r", {"dit": final}, True, Sampling()))
            ]
            return final["latents"], image["images"]

        finals = await asyncio.gather(*(denoised(*job) for job in jobs))
        together = await asyncio.gather(*(decoded(final) for final in finals))
        sizes = denoise.batcher.batch_sizes.copy(), decode.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await decoded(await denoised(*job)) for job in jobs]
        return together, alone, *sizes

    together, alone, denoise_batches, decode_batches = asyncio.run(go())
    assert max(denoise_batches) == 3 and decode_batches == {1: 2, 2: 1}, (denoise_batches, decode_batches)
    for (latents, images), (latents_alone, images_alone) in zip(together, alone, strict=True):
        torch.testing.assert_close(latents, latents_alone, rtol=1e-4, atol=1e-4)
        assert images.shape == images_alone.shape
        assert (images.int() - images_alone.int()).abs().max() <= 1


def test_uneven_prompts_are_padded_and_masked(pixart: Path) -> None:
    """A negative prompt longer than the prompt: padding masked out changes nothing."""
    engine = started(stage("denoise", pixart, width=16, height=16))
    assert isinstance(engine, DenoiseEngine)
    plan = engine._plan(torch.randn(3, 64), torch.randn(6, 64), Sampling(n=2, guidance_scale=2.0, seed=0))
    assert (
        plan.cond.shape == (4, 6, 64) and plan.mask.tolist() == [[1.0] * 6] * 2 + [[1.0] * 3 + [0.0] * 3] * 2
    )


@pytest.mark.parametrize(
    ("sampling", "says"),
    [
        ({"width": 20}, "multiples of 8"),
        ({"width": 2048}, "from 8 to 1024"),
        ({"n": 11}, "n: 11"),
        ({"num_inference_steps": 1001}, "num_inference_steps"),
        ({"guidance_scale": -1}, "guidance_scale"),
    ],
)
def test_what_the_model_cannot_make_is_refused(pixart: Path, sampling: dict[str, Any], says: str) -> None:
    engine = started(stage("denoise", pixart))
    with pytest.raises(InvalidRequest, match=says):
        outputs(engine, {"encoder": {"prompt_embeds": torch.randn(1, 2, 64)}}, sampling)


def test_the_encoder_mode_gives_the_last_hidden_states(demo_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    models = demo_dir / "models"
    spec = StageSpec(
        name="encoder",
        engine=EngineSpec(
            kind=EngineKind.TRANSFORMERS, model=str(models / "tiny-thinker"), args={"mode": "encode"}
        ),
        inputs=[InputSpec.model_validate({"from": "request"})],
    )
    [out] = outputs(
        started(build_engine(spec)), {"request": {"prompt": "a fox", "negative_prompt": "rain"}}, {}
    )
    tok = AutoTokenizer.from_pretrained(models / "tiny-thinker")
    base = AutoModel.from_pretrained(models / "tiny-thinker")
    for key, text in (("prompt_embeds", "a fox"), ("negative_prompt_embeds", "rain")):
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        expected = base(input_ids=ids).last_hidden_state
        assert out.data[key].shape == (1, ids.shape[1], 64)
        assert torch.allclose(out.data[key], expected, atol=1e-5)
    assert out.units == 1


def test_a_role_is_required(pixart: Path) -> None:
    with pytest.raises(Exception, match="role must be 'encode', 'denoise' or 'decode'"):
        stage("sample", pixart)
