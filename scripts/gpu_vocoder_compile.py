"""The token2wav stage's `compile` switch on a GPU: Qwen2.5-Omni's DiT and BigVGAN, in chunks
of 12 codes as the streaming examples run it, eager, `compile: true` and `compile:
reduce-overhead` (CUDA graphs), on the demo's tiny checkpoint: seconds per streamed decode
once warm, how long the first (compiling) decode took, and how far the audio is from eager's.

Not part of the suite (CI has no GPU; tests/unit holds compiled == eager on the CPU). Run on a
CUDA machine from the repository root with the project importable, the demo models under MODELS:
    python scripts/gpu_vocoder_compile.py MODELS OUT.json [--codes 96] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall
from omni_stage.engines.registry import build_engine

WINDOW = 12
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen2.5-omni.yaml"


def token2wav(model: Path, **args: Any) -> Engine:
    """The example's code2wav stage on `model`, with `args` over its own."""
    spec = load_pipeline(EXAMPLE).spec.stage("code2wav")
    engine = spec.engine.model_copy(update={"model": str(model), "args": {**spec.engine.args, **args}})
    return build_engine(spec.model_copy(update={"engine": engine}))


async def decode(vocoder: Engine, codes: torch.Tensor, sampling: dict[str, Any]) -> torch.Tensor:
    state, audio = CallState(), []
    for i in range(0, len(codes), WINDOW):
        last = i + WINDOW >= len(codes)
        call = EngineCall(
            "r", {"talker": {"codes": codes[i : i + WINDOW]}}, last, Sampling.of(sampling), state
        )
        audio += [o.data["audio"] async for o in vocoder.generate(call)]
    return torch.cat(audio)


def measure(vocoder: Engine, codes: torch.Tensor, sampling: dict[str, Any], device: str) -> dict[str, Any]:
    def once() -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        audio = asyncio.run(decode(vocoder, codes, sampling))
        if device == "cuda":
            torch.cuda.synchronize()
        return audio, time.perf_counter() - t0

    _, first = once()
    once()  # CUDA graphs record on the runs after the first
    times = [once()[1] for _ in range(3)]
    audio, _ = once()
    return {"audio": audio, "first_s": round(first, 2), "warm_s": round(min(times), 4)}


def family(
    name: str, build: Any, codes: torch.Tensor, sampling: dict[str, Any], device: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    eager: torch.Tensor | None = None
    for mode in (False, True, "reduce-overhead"):
        vocoder = build(compile=mode, device=device)
        asyncio.run(vocoder.start())
        got = measure(vocoder, codes, sampling, device)
        audio = got.pop("audio")
        eager = audio if eager is None else eager
        got["max_abs_diff_vs_eager"] = float((audio - eager).abs().max())
        out[{False: "eager", True: "compile", "reduce-overhead": "reduce-overhead"}[mode]] = got
        print(name, mode, got, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--codes", type=int, default=96)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        "torch": torch.__version__,
        "codes": a.codes,
    }
    q25 = a.models / "tiny-qwen2.5-omni"
    result["qwen2.5-omni token2wav"] = family(
        "token2wav",
        lambda **args: token2wav(q25, chunkCodes=12, **args),
        torch.randint(0, 8192, (a.codes,), generator=g),
        {"voice": "Ethan", "seed": 1},
        a.device,
    )
    a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
