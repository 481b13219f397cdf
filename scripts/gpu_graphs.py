"""Qwen3-Omni's talker replayed as CUDA graphs at the real model's size, its code predictor's
frames and its decode steps: the same codes as the same frame or step run eagerly, and their
times graphed, eager at fixed shapes, and as the stage runs them without graphs (a frame
through transformers' `generate`; a step on the slot table's own shapes), by batch size.

The talker stage with `cudaGraphs: true` on CUDA captures its frames at start (omni_stage.models.
qwen3_omni.code_predictor.StaticFrames); this builds it as a stage does, on a config-only checkpoint at
Qwen3-Omni-30B-A3B's sizes with `loadFormat: dummy`, and compares its graphs' codes with the
same StaticFrames run without graphs (identical kernels: equal to the bit), and, for the
record only, with `generate`'s (bf16 on random weights of +-1e-3 puts many logits within a
rounding of each other, so a different kernel order may pick another: that agreement is
printed, not required; tests/unit/test_qwen3_omni.py holds the fixed-shape frame equal to
`generate` in float32 on this CPU). The decode steps (engines/fixed_steps.py) likewise: the
stage's captured steps against the same steps at fixed shapes on a table of their own
(equal to the bit), and the table's own steps (agreement printed); each of B requests a
prompt of 16 random rows, then steps of random rows. Whether the steps could be captured at
all (the talker's MoE layers route tokens by their values) is in `steps_captured`.

On a GPU, from the repository root, the project importable:
    python scripts/gpu_graphs.py OUT.json [--batches 1 8 16] [--frames 20]
`--device cpu --sizes tiny` runs the same at the demo's sizes with `fixedSteps` for
`cudaGraphs` (the fixed-shape frames and steps a graph captures, uncaptured: nothing is
captured on a CPU): the suite's check that the script runs (tests/unit/test_gpu_scripts.py),
so that a GPU's few minutes are not spent on a script that no longer fits the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.in_process import stage_engine
from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.engines.slot_cache import SlotCache, SlotSteps
from omni_stage.models.qwen3_omni.checkpoint import TINY, write_config_only
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen3-omni.yaml"


def generate(talker: Any, hidden: torch.Tensor, code0: list[int], groups: int) -> list[list[int]]:
    """The frames as the reference's talker draws them: its code predictor's `generate`."""
    first = talker.get_input_embeddings()(torch.tensor([[c] for c in code0], device=hidden.device))
    codes = talker.code_predictor.generate(
        inputs_embeds=torch.cat([hidden, first], dim=1), max_new_tokens=groups - 1, do_sample=False
    )
    return codes[:, -(groups - 1) :].tolist()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], frames: int) -> float:
    """Milliseconds a call, the device synchronised, over `frames` calls after one."""
    fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(frames):
        fn()
    synchronize()
    return round((time.perf_counter() - t0) / frames * 1000, 3)


PROMPT = 16


def span(at: int, n: int, device: torch.device) -> torch.Tensor:
    """[4, 1, n]: a text-only Qwen3-Omni talker's position ids (its text row and M-RoPE's)."""
    return torch.arange(at, at + n, device=device).view(1, 1, -1).expand(4, 1, -1)


def spoken(
    steps: SlotSteps, head: torch.nn.Module, prompts: torch.Tensor, rows: torch.Tensor
) -> list[list[int]]:
    """Each request's greedy code 0 a step ([steps][requests]): `prompts` [B, PROMPT, H]
    prefilled into slots of `steps`' table, then `rows` [K, B, 1, H] a step each, the codec
    `head` on the decoder's output."""
    on = prompts.device
    slots = [steps.table.take() for _ in range(prompts.shape[0])]
    for i, s in enumerate(slots):
        steps.prefill(s, None, span(0, PROMPT, on), prompts[i : i + 1])
    codes = []
    for k in range(rows.shape[0]):
        out, at = steps.step(slots, span(PROMPT + k, 1, on).expand(-1, len(slots), -1), rows[k])
        codes.append(head(out.last_hidden_state)[at, -1].argmax(-1).tolist())
    for s in slots:
        steps.table.give_back(s)
    return codes


def step_ms(steps: SlotSteps, n: int, width: int, count: int, on: torch.device, dtype: torch.dtype) -> float:
    """Milliseconds a decode step of n requests (after a prompt each), synchronised."""
    prompts = torch.randn(n, PROMPT, width, device=on, dtype=dtype)
    rows = torch.randn(count + 1, n, 1, width, device=on, dtype=dtype)
    slots = [steps.table.take() for _ in range(n)]
    for i, s in enumerate(slots):
        steps.prefill(s, None, span(0, PROMPT, on), prompts[i : i + 1])
    steps.step(slots, span(PROMPT, 1, on).expand(-1, n, -1), rows[0])
    synchronize()
    t0 = time.perf_counter()
    for k in range(1, count + 1):
        steps.step(slots, span(PROMPT + k, 1, on).expand(-1, n, -1), rows[k])
    synchronize()
    for s in slots:
        steps.table.give_back(s)
    return round((time.perf_counter() - t0) / count * 1000, 3)


def decode_steps(talker: Any, batches: list[int], count: int) -> dict[str, Any]:
    """The stage's decode steps (captured with `cudaGraphs`) against the same at fixed shapes
    uncaptured, and the table's own, by batch size."""
    m = talker.model
    config = m.config.text_config
    width, most = int(config.hidden_size), max(batches)
    on, dtype = m.device, m.dtype

    def table() -> SlotCache:
        return SlotCache.of(config, most, dtype, on)

    graphed: FixedSteps = talker.stepper  # (the talker's decoder, as the stage steps it)
    eager = FixedSteps(table(), m.model, most, width, 4, False)
    own = SlotSteps(table(), m.model)
    found: dict[str, Any] = {"steps_captured": graphed.captured, "batches": {}}
    for n in batches:
        prompts = torch.randn(n, PROMPT, width, device=on, dtype=dtype)
        rows = torch.randn(count, n, 1, width, device=on, dtype=dtype)
        ours, fixed, theirs = (spoken(s, m.codec_head, prompts, rows) for s in (graphed, eager, own))
        found["batches"][n] = {
            "graphed_equals_eager": ours == fixed,
            "steps_equal_to_own": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "graphed_ms": step_ms(graphed, n, width, count, on, dtype),
            "eager_fixed_ms": step_ms(eager, n, width, count, on, dtype),
            "own_ms": step_ms(own, n, width, count, on, dtype),
        }
        print("steps", n, json.dumps(found["batches"][n]), flush=True)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--frames", type=int, default=20)
    p.add_argument("--model-dir", default="/tmp/omni-config-only/qwen3-omni")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sizes", choices=("full", "tiny"), default="full")
    a = p.parse_args()
    cuda = a.device == "cuda"
    model = write_config_only(Path(a.model_dir), *([] if a.sizes == "full" else [TINY]))
    talker = stage_engine(
        EXAMPLE,
        "talker",
        model,
        max(a.batches),
        device=a.device,
        dtype="bfloat16" if cuda else "float32",
        loadFormat="dummy",
        **{"cudaGraphs" if cuda else "fixedSteps": True},
        maxModelLen=512,  # (its table allocated at load, each bucket captured over spans of 256 and 512)
    )
    t0 = time.perf_counter()
    asyncio.run(talker.start())  # captures the frames' graphs
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "start_s": round(time.perf_counter() - t0, 1),
        "captured": talker.frames.captured,  # type: ignore[attr-defined]
        "batches": {},
    }
    graphed: StaticFrames = talker.frames  # type: ignore[attr-defined]
    m, groups = talker.model, talker.groups  # type: ignore[attr-defined]
    width = m.code_predictor.config.hidden_size
    codes = m.code_predictor.config.vocab_size
    with torch.inference_mode():
        eager = StaticFrames(m, groups, max(a.batches), capture=False)
        for n in a.batches:
            hidden = torch.randn(n, 1, width, device=m.device, dtype=m.dtype)
            code0 = torch.randint(0, codes, (n,)).tolist()
            ours = graphed.residuals(hidden, code0)
            theirs = generate(m, hidden, code0, groups)
            result["batches"][n] = {
                "graphed_equals_eager": ours == eager.residuals(hidden, code0),
                "rows_equal_to_generate": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                "graphed_ms": timed(lambda h=hidden, c=code0: graphed.residuals(h, c), a.frames),
                "eager_fixed_ms": timed(lambda h=hidden, c=code0: eager.residuals(h, c), a.frames),
                "generate_ms": timed(lambda h=hidden, c=code0: generate(m, h, c, groups), a.frames),
            }
            print(n, json.dumps(result["batches"][n]), flush=True)
        result["decode_steps"] = decode_steps(talker, a.batches, a.frames)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"{'batch':>5} {'graphed ms':>10} {'eager fixed':>11} {'generate':>9} {'same':>5}")
    for n, r in result["batches"].items():
        row = (n, r["graphed_ms"], r["eager_fixed_ms"], r["generate_ms"], str(r["graphed_equals_eager"]))
        print("{:>5} {:>10} {:>11} {:>9} {:>5}".format(*row))


if __name__ == "__main__":
    main()
