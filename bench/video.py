"""video: Wan 2.1 text-to-video through the staged pipeline (examples/tiny-video.yaml: encoder ->
dit -> vae, as `omni serve` runs it) against diffusers' own `WanPipeline` on the same
checkpoint (the demo's tiny-video), in the same run, on the same cores.

Denoising steps per second, whole videos timed (text encoding and decoding included):
- diffusers: `WanPipeline(...)` in this process, one video after another, one thread (as
  each stage of the pipeline has one);
- sync: POST /v1/videos/sync, one video after another;
- jobs: POST /v1/videos with J jobs in flight (J = 1, 2, 4; the gateway's `concurrency` set
  to J), polled until all complete: what a job costs over a request (its progress reports,
  the store, the MP4 and its previews written) and what jobs in flight buy.

Ratios, measured in the run: `sync_vs_diffusers` and `job_c1_vs_diffusers` (steps per second
over diffusers'; goal >= 0.9), and `jobs_c4_vs_c1` (steps per second with four jobs in flight
over one).
"""

from __future__ import annotations

import copy
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

import httpx
import torch
import yaml

from bench.common import bars, figure, machine, parser, report, rounds, save, warmed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
SIZE: Final = (96, 96)
FRAMES: Final = 17
STEPS: Final = 20
IN_FLIGHT: Final = (1, 2, 4)


def reference(models: Path, videos: int, warm: bool) -> float:
    """diffusers' WanPipeline: steps per second over `videos` videos, one after another."""
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    pipe = WanPipeline.from_pretrained(models / "tiny-video")
    pipe.set_progress_bar_config(disable=True)

    def one(seed: int) -> None:
        pipe(
            prompt="a red fox in the snow",
            width=SIZE[0],
            height=SIZE[1],
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        )

    if warm:
        one(0)
    t0 = time.perf_counter()
    for seed in range(videos):
        one(seed)
    return STEPS * videos / (time.perf_counter() - t0)


FORM: Final = {
    "prompt": "a red fox in the snow",
    "size": f"{SIZE[0]}x{SIZE[1]}",
    "num_frames": str(FRAMES),
    "num_inference_steps": str(STEPS),
}


def sync(base: str, videos: int, warm: bool) -> float:
    def one(seed: int) -> None:
        r = httpx.post(f"{base}/v1/videos/sync", data={**FORM, "seed": str(seed)}, timeout=600)
        r.raise_for_status()

    if warm:
        one(0)
    t0 = time.perf_counter()
    for seed in range(videos):
        one(seed)
    return STEPS * videos / (time.perf_counter() - t0)


def jobs(base: str, videos: int) -> float:
    """`videos` jobs made at once, polled until every one has completed."""
    with httpx.Client(base_url=base, timeout=60) as client:
        t0 = time.perf_counter()
        ids = [client.post("/v1/videos", data={**FORM, "seed": str(s)}).json()["id"] for s in range(videos)]
        pending = set(ids)
        while pending:
            for i in list(pending):
                status = client.get(f"/v1/videos/{i}").json()["status"]
                if status == "failed":
                    raise RuntimeError(f"video job {i} failed")
                if status == "completed":
                    pending.discard(i)
            time.sleep(0.01)  # a client's poll interval
        return STEPS * videos / (time.perf_counter() - t0)


def measure(args: Any) -> dict[str, Any]:
    n = rounds(6, args)
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-video.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    out: dict[str, Any] = {}
    with demo_models() as cwd, tempfile.TemporaryDirectory() as state:
        results: dict[str, float] = {}
        # The reference in a thread of its own so that it, like every stage, has one compute thread.
        worker = threading.Thread(
            target=lambda: results.update(diffusers=reference(cwd / "models", n, warmed(args)))
        )
        worker.start()
        worker.join()
        out["diffusers_steps_per_s"] = round(results["diffusers"], 2)
        for j in IN_FLIGHT if not args.quick else (1, 2):
            spec["gateway"]["videos"] = {"stateDir": state, "concurrency": j, "maxQueuedPerKey": 64}
            with served("bench", spec, cwd=cwd) as base:
                if j == 1:
                    out["sync_steps_per_s"] = round(sync(base, n, warmed(args)), 2)
                if warmed(args):
                    jobs(base, j)
                out[f"jobs_c{j}_steps_per_s"] = round(jobs(base, n * j if j > 1 else n), 2)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    runs = result["runs"]
    names = [k.removesuffix("_steps_per_s") for k in runs]
    bars(ax, names, {"denoising steps per second": list(runs.values())}, "steps/s", "tiny Wan 2.1, CPU")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    runs = measure(args)
    ref = runs["diffusers_steps_per_s"]
    ratios = {
        "sync_vs_diffusers": round(runs["sync_steps_per_s"] / ref, 3),
        "job_c1_vs_diffusers": round(runs["jobs_c1_steps_per_s"] / ref, 3),
        "jobs_c2_vs_c1": round(runs["jobs_c2_steps_per_s"] / runs["jobs_c1_steps_per_s"], 3),
    }
    if "jobs_c4_steps_per_s" in runs:
        ratios["jobs_c4_vs_c1"] = round(runs["jobs_c4_steps_per_s"] / runs["jobs_c1_steps_per_s"], 3)
    result = {"benchmark": "video", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [(k, str(v)) for k, v in runs.items()] + [(k, str(v)) for k, v in ratios.items()]
    report("video", rows, result, args, plot)


if __name__ == "__main__":
    main()
