"""image: image generation and editing through the staged pipelines, edits against diffusers'
own `QwenImageEditPipeline` on the same checkpoint (the demo's tiny-image-edit), in the same
run, on the same cores.

Edits (examples/tiny-image-edit.yaml: the Qwen2.5-VL encoder with the VAE's encoder -> the
Qwen-Image transformer -> the VAE's decoder), a 64x64 input edited at its size, whole requests
timed (the image's conditioning at about a megapixel, as the pipeline makes it, included):
- diffusers: `QwenImageEditPipeline(...)` in this process, one edit after another, one thread
  (as each stage of the pipeline has one);
- c1: POST /v1/images/edits, one after another;
- c4: four clients at once, each one after another (requests in flight overlap the stages and
  share the transformer's forwards).
Generations (examples/tiny-image.yaml, 64x64): c1 and c4 the same way.

Ratios, measured in the run: `edit_c1_vs_diffusers` (edits per second over diffusers'; goal
>= 0.9), `edits_c4_vs_c1` and `generations_c4_vs_c1` (four clients over one).
"""

from __future__ import annotations

import base64
import copy
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import httpx
import numpy as np
import torch
import yaml
from PIL import Image

from bench.common import bars, figure, machine, parser, report, rounds, save, warmed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
SIDE: Final = 64
STEPS: Final = 20
PROMPT: Final = "make the sky stormy"
CLIENTS: Final = 4


def picture(seed: int) -> Image.Image:
    rgb = (np.random.default_rng(seed).random((SIDE, SIDE, 3)) * 255).astype(np.uint8)
    return Image.fromarray(rgb)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def reference(models: Path, edits: int, steps: int, warm: bool) -> float:
    """diffusers' QwenImageEditPipeline: edits per second, one after another."""
    from diffusers import QwenImageEditPipeline

    torch.set_num_threads(1)
    pipe = QwenImageEditPipeline.from_pretrained(models / "tiny-image-edit")
    pipe.set_progress_bar_config(disable=True)

    def one(seed: int) -> None:
        pipe(
            picture(seed),
            PROMPT,
            height=SIDE,
            width=SIDE,
            num_inference_steps=steps,
            true_cfg_scale=1.0,  # no negative prompt: no guidance, as the stage runs it (and no warning)
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        )

    if warm:
        one(0)
    t0 = time.perf_counter()
    for seed in range(edits):
        one(seed)
    return edits / (time.perf_counter() - t0)


def edit(client: httpx.Client, seed: int, steps: int) -> None:
    r = client.post(
        "/v1/images/edits",
        files={"image": ("in.png", png(picture(seed)), "image/png")},
        data={"prompt": PROMPT, "num_inference_steps": str(steps), "seed": str(seed)},
    )
    r.raise_for_status()
    Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).load()


def generate(client: httpx.Client, seed: int, steps: int) -> None:
    r = client.post(
        "/v1/images/generations",
        json={"prompt": PROMPT, "size": f"{SIDE}x{SIDE}", "num_inference_steps": steps, "seed": seed},
    )
    r.raise_for_status()


def per_second(base: str, call: Any, requests: int, clients: int, steps: int, warm: bool) -> float:
    """Requests per second with `clients` clients, each sending `requests` one after another."""

    def client_run(c: int, client: httpx.Client) -> None:
        for i in range(requests):
            call(client, c * requests + i, steps)

    with httpx.Client(base_url=base, timeout=600) as client:
        if warm:
            call(client, 0, steps)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client_run, range(clients), [client] * clients))
        return clients * requests / (time.perf_counter() - t0)


def spec_of(example: str) -> dict[str, Any]:
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / example).read_text())["spec"])
    spec["servedModelName"] = "bench"
    return spec  # type: ignore[no-any-return]


def measure(args: Any) -> dict[str, Any]:
    n = rounds(5, args)
    steps = STEPS if not args.quick else 2
    warm = warmed(args)
    out: dict[str, Any] = {}
    with demo_models() as cwd:
        results: dict[str, float] = {}
        # The reference in a thread of its own so that it, like every stage, has one compute thread.
        worker = threading.Thread(
            target=lambda: results.update(diffusers=reference(cwd / "models", n, steps, warm))
        )
        worker.start()
        worker.join()
        out["edit_diffusers_per_s"] = round(results["diffusers"], 3)
        with served("bench", spec_of("tiny-image-edit.yaml"), cwd=cwd) as base:
            out["edit_c1_per_s"] = round(per_second(base, edit, n, 1, steps, warm), 3)
            out[f"edit_c{CLIENTS}_per_s"] = round(
                per_second(base, edit, 1 if args.quick else n, CLIENTS, steps, warm), 3
            )
        with served("bench", spec_of("tiny-image.yaml"), cwd=cwd) as base:
            out["generation_c1_per_s"] = round(per_second(base, generate, n, 1, steps, warm), 3)
            out[f"generation_c{CLIENTS}_per_s"] = round(
                per_second(base, generate, n, CLIENTS, steps, warm), 3
            )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    runs = result["runs"]
    names = [k.removesuffix("_per_s") for k in runs]
    bars(
        ax,
        names,
        {"images per second": list(runs.values())},
        "images/s",
        "tiny Qwen-Image-Edit, tiny PixArt, CPU",
    )
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    runs = measure(args)
    ratios = {
        "edit_c1_vs_diffusers": round(runs["edit_c1_per_s"] / runs["edit_diffusers_per_s"], 3),
        f"edits_c{CLIENTS}_vs_c1": round(runs[f"edit_c{CLIENTS}_per_s"] / runs["edit_c1_per_s"], 3),
        f"generations_c{CLIENTS}_vs_c1": round(
            runs[f"generation_c{CLIENTS}_per_s"] / runs["generation_c1_per_s"], 3
        ),
    }
    result = {"benchmark": "image", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [(k, str(v)) for k, v in runs.items()] + [(k, str(v)) for k, v in ratios.items()]
    report("image", rows, result, args, plot)


if __name__ == "__main__":
    main()
