"""Qwen-Image-Edit as three diffusers stages driven directly (encode -> denoise -> decode,
chained by hand as the stages of examples/tiny-image-edit.yaml are): the image equals that of
diffusers' own `QwenImageEditPipeline` for the same checkpoint (the demo's tiny-image-edit,
random weights), image, instruction and seed; the output's size; previews; what a request
cannot ask for; concurrent requests sharing the transformer's forward."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import EngineCall, InvalidRequest
from omni_stage.payload import concat
from omni_stage.segments import EngineOutput
from tests.unit.test_diffusion import outputs, stage, started

PROMPT = "make the sky green"


@pytest.fixture(scope="module")
def qwen_edit(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-image-edit"


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)


def request(rgb: np.ndarray, negative: str | None = None, images: int = 1) -> dict[str, Any]:
    req: dict[str, Any] = {
        "prompt": PROMPT,
        "images": [f"m{i}" for i in range(images)],
        "media": {f"m{i}": torch.from_numpy(rgb) for i in range(images)},
    }
    if negative is not None:
        req["negative_prompt"] = negative
    return req


def edit(
    model: Path, req: dict[str, Any], sampling: dict[str, Any], **denoise_args: Any
) -> tuple[list[EngineOutput], list[EngineOutput]]:
    """The three stages on one request: the denoiser's units and the decoder's."""
    [cond] = outputs(started(stage("encode", model)), {"request": req}, {})
    latents = outputs(started(stage("denoise", model, **denoise_args)), {"encoder": cond.data}, sampling)
    images = outputs(started(stage("decode", model)), {"dit": concat([o.data for o in latents])}, {})
    return latents, images


@pytest.mark.parametrize(
    ("negative", "dtype"), [(None, "float32"), ("blurry, dark", "float32"), (None, "bfloat16")]
)
def test_qwen_image_edit_matches_the_diffusers_pipeline(
    qwen_edit: Path, negative: str | None, dtype: str
) -> None:
    """Exactly: the pipeline's own conditioning code on the stage's parts, the same loop; with
    a negative, the pipeline's true guidance (the prompt's and the negative's rows in one
    forward here, the shorter one padded and masked; two forwards there). In bfloat16 too: the
    noise drawn and the latents stepped in it, as the pipeline's are (the last level apart: the
    pipeline rounds the decoded image in bfloat16, the stage in float32)."""
    from diffusers import QwenImageEditPipeline
    from PIL import Image

    rgb = picture(48, 64)
    sampling = {"num_inference_steps": 4, "guidance_scale": 4.0, "seed": 3}
    [cond] = outputs(
        started(stage("encode", qwen_edit, dtype=dtype)), {"request": request(rgb, negative)}, {}
    )
    latents = outputs(started(stage("denoise", qwen_edit, dtype=dtype)), {"encoder": cond.data}, sampling)
    images = outputs(
        started(stage("decode", qwen_edit, dtype=dtype)), {"dit": concat([o.data for o in latents])}, {}
    )
    ours = images[-1].data["images"][0].numpy()

    torch_dtype = getattr(torch, dtype)
    ref = QwenImageEditPipeline.from_pretrained(qwen_edit, torch_dtype=torch_dtype)(
        Image.fromarray(rgb),
        PROMPT,
        negative_prompt=negative,
        true_cfg_scale=4.0,
        num_inference_steps=4,
        height=48,
        width=64,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).images
    assert ours.shape == (1, 48, 64, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(np.float32) - np.round(ref * 255)).max() <= 1


def test_the_output_is_the_inputs_size_within_the_models_limits(qwen_edit: Path) -> None:
    """Unless the request sets a size: the input's, rounded down to multiples of 16 (the
    VAE's 8 times the transformer's 2x2 patches), scaled down into maxSize; and previews."""
    sampling = {"num_inference_steps": 2, "seed": 1}
    _, images = edit(qwen_edit, request(picture(70, 100)), sampling)
    assert images[-1].data["images"].shape == (1, 1, 64, 96, 3)

    _, images = edit(qwen_edit, request(picture(96, 128)), sampling, maxSize=64)
    assert images[-1].data["images"].shape == (1, 1, 48, 64, 3)

    asked = {**sampling, "width": 32, "height": 48, "n": 2, "previews": True, "partial_images": 1}
    latents, images = edit(qwen_edit, request(picture(48, 64)), {**asked, "num_inference_steps": 4})
    assert [int(o.data["step"][0]) for o in latents] == [2, 4]
    assert [bool(o.data["final"][0]) for o in latents] == [False, True]
    assert images[-1].data["images"].shape == (1, 2, 48, 32, 3)


@pytest.mark.parametrize(
    ("images", "sampling", "says"),
    [
        (2, {}, "image: this model edits one image at a time; 2 given"),
        (0, {}, "image: this model edits one image at a time; 0 given"),
        (1, {"width": 40}, "size: 40x48: this model makes widths and heights that are multiples of 16"),
        (1, {"num_inference_steps": 1001}, "num_inference_steps"),
    ],
)
def test_what_the_model_cannot_do_is_refused(
    qwen_edit: Path, images: int, sampling: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        edit(qwen_edit, request(picture(48, 64), images=images), sampling)


def test_concurrent_edits_step_together(qwen_edit: Path) -> None:
    """Three requests at once, two of one size (they share each transformer forward, one of
    them guided: its prompt's and negative's rows ride along) and one of another: each one's
    latents are what it gets alone, within float32's batched-matmul noise."""
    [cond] = outputs(started(stage("encode", qwen_edit)), {"request": request(picture(48, 64), "dark")}, {})
    unguided = {k: v for k, v in cond.data.items() if k != "negative_prompt_embeds"}
    jobs = [
        (cond.data, {"seed": 1}),
        (unguided, {"seed": 2}),
        (unguided, {"seed": 3, "width": 32}),
    ]

    async def go() -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, int]]:
        denoise = stage("denoise", qwen_edit, steps=3, maxBatch=4)
        await denoise.start()

        async def final(inputs: dict[str, Any], sampling: dict[str, Any]) -> torch.Tensor:
            call = EngineCall("r", {"encoder": inputs}, True, Sampling.of(sampling))
            outs = [o.data async for o in denoise.generate(call)]
            return outs[-1]["latents"]  # type: ignore[no-any-return]

        together = await asyncio.gather(*(final(*job) for job in jobs))
        sizes = denoise.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await final(*job) for job in jobs]
        return list(together), alone, sizes

    together, alone, batches = asyncio.run(go())
    assert max(batches) == 2, batches
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
