"""The diffusers stages on a GPU against diffusers' own pipelines on the same GPU: Qwen-Image-Edit
(guided or not, float32 and bfloat16) and Wan 2.1 (float32), the same checkpoints (the demo's
tiny-image-edit and tiny-video), inputs and seeds; how far apart the images are, in 8-bit
levels, and how long an edit takes each way (the stages called directly, no serving).

Not part of the suite (CI has no GPU). Run on a CUDA machine from the repository root with the
project importable, the demo models under MODELS:
    python scripts/gpu_diffusers_parity.py MODELS OUT.json [--unguided] [--steps 20]
`--device cpu` runs the same on the CPU. What it found is in docs/models.md (Qwen-Image-Edit).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_stage.payload import concat
from tests.unit.test_diffusion import outputs, stage, started

PROMPT = "make the sky green"
HEIGHT, WIDTH = 256, 320


def levels_apart(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    diff = np.abs(ours.astype(np.float32) - np.round(ref * 255))
    return {"max_levels": float(diff.max()), "mean_levels": round(float(diff.mean()), 4)}


def timed(fn: Any, device: str, repeats: int = 3) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / repeats, 4)


def edit(models: Path, device: str, dtype: str, negative: str | None, steps: int) -> dict[str, Any]:
    from diffusers import QwenImageEditPipeline

    model = models / "tiny-image-edit"
    rgb = (np.random.default_rng(0).random((HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
    args = {"device": device, "dtype": dtype}
    enc, den, dec = (started(stage(role, model, **args)) for role in ("encode", "denoise", "decode"))
    request: dict[str, Any] = {"prompt": PROMPT, "images": ["m0"], "media": {"m0": torch.from_numpy(rgb)}}
    if negative is not None:
        request["negative_prompt"] = negative

    def ours() -> np.ndarray:
        [cond] = outputs(enc, {"request": request}, {})
        sampling = {"num_inference_steps": steps, "guidance_scale": 4.0, "seed": 3}
        latents = outputs(den, {"encoder": cond.data}, sampling)
        return outputs(dec, {"dit": concat([o.data for o in latents])}, {})[-1].data["images"][0].numpy()  # type: ignore[no-any-return]

    pipe = QwenImageEditPipeline.from_pretrained(model, torch_dtype=getattr(torch, dtype)).to(device)
    pipe.set_progress_bar_config(disable=True)

    def ref() -> np.ndarray:
        return pipe(  # type: ignore[no-any-return]
            Image.fromarray(rgb),
            PROMPT,
            negative_prompt=negative,
            true_cfg_scale=4.0 if negative is not None else 1.0,
            num_inference_steps=steps,
            height=HEIGHT,
            width=WIDTH,
            generator=torch.Generator().manual_seed(3),
            output_type="np",
        ).images

    return {**levels_apart(ours(), ref()), "staged_s": timed(ours, device), "diffusers_s": timed(ref, device)}


def wan(models: Path, device: str, steps: int) -> dict[str, Any]:
    from diffusers import WanPipeline

    model = models / "tiny-video"
    enc, den, dec = (started(stage(role, model, device=device)) for role in ("encode", "denoise", "decode"))
    sampling = {
        "width": 64,
        "height": 48,
        "num_frames": 9,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
    }
    [cond] = outputs(enc, {"request": {"prompt": "a fox", "negative_prompt": "blur"}}, {})
    latents = outputs(den, {"encoder": cond.data}, {**sampling, "seed": 3})
    ours = outputs(dec, {"dit": concat([o.data for o in latents])}, {})[-1].data["frames"][0].numpy()
    ref = (
        WanPipeline.from_pretrained(model)
        .to(device)(
            prompt="a fox",
            negative_prompt="blur",
            generator=torch.Generator().manual_seed(3),
            output_type="np",
            **sampling,
        )
        .frames
    )
    return levels_apart(ours, ref)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--unguided", action="store_true", help="edits without a negative prompt (no guidance)")
    a = p.parse_args()
    negative = None if a.unguided else "blurry"
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else a.device
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "guided": not a.unguided}
    for dtype in ("float32", "bfloat16"):
        result[f"edit_{dtype}"] = edit(a.models, a.device, dtype, negative, a.steps)
        print(json.dumps(result), flush=True)
    result["wan_float32"] = wan(a.models, a.device, a.steps // 2)
    print(json.dumps(result), flush=True)
    a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
