"""What a CUDA graph replays waits for nothing on the host: the fixed-shape decode steps of
every thinker and talker (engines/fixed_steps.py) and the code predictors' frames
(code_predictor.StaticFrames) issue no operation that reads a tensor's values back (`.item()`,
`bool()`, `.tolist()`, `.cpu()`), nor one whose output's shape depends on its values
(`nonzero`, and boolean indexing built on it): on CUDA each is a wait for the device, which a
capture refuses. Checked here, with no GPU, by seeing every operation the forward dispatches
(a TorchDispatchMode) and every call it makes of a tensor's methods that copy to the host (a
profile hook: on a CPU those dispatch nothing), on the tiny checkpoints. A proxy, not the
capture itself: a kernel that only CUDA runs (the MoE layers' grouped matmuls run a fallback
on a CPU) is not seen, and what the capture makes of them is for scripts/gpu_graphs.py and
scripts/gpu_bench.py on a GPU."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from tests.helpers import ROOT, example_stage

WAITS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "repeat_interleave", "equal")
"""The aten operations that wait for the device (their names' stems)."""
TO_HOST = frozenset({"tolist", "cpu", "numpy"})
"""A tensor's methods that copy it to the host (on a CPU tensor: without a dispatch)."""


class Dispatched(TorchDispatchMode):
    """Every aten operation dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        if name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.ops["index by a mask (nonzero)"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def waits(self) -> dict[str, int]:
        return {op: n for op, n in self.ops.items() if op.startswith((*WAITS, "index by a mask"))}


@contextmanager
def host_copies() -> Iterator[Counter[str]]:
    """The calls of a tensor's methods that copy it to the host (TO_HOST) made inside it."""
    seen: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") in TO_HOST:
            seen[arg.__name__] += 1

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize(
    ("example", "checkpoint", "stage"),
    [
        ("qwen2.5-omni", "tiny-qwen2.5-omni", "thinker"),
        ("qwen2.5-omni", "tiny-qwen2.5-omni", "talker"),
        ("qwen3-omni", "tiny-qwen3-omni", "thinker"),
        ("qwen3-omni", "tiny-qwen3-omni", "talker"),
        ("qwen3-tts", "tiny-qwen3-tts", "talker"),
    ],
)
def test_a_graphed_step_waits_for_nothing_on_the_host(
    demo_dir: Path, example: str, checkpoint: str, stage: str
) -> None:
    """The stage's fixed-shape step of its largest bucket over its shortest and longest spans,
    and its code predictor's frame where it has one, after a first run (which installs
    transformers' output hooks, as the capture's warm-up runs do)."""
    args = {"fixedSteps": True, "maxModelLen": 512}  # (spans of 256 and 512 positions)
    engine = example_stage(
        ROOT / "examples" / f"{example}.yaml", stage, demo_dir / "models" / checkpoint, **args
    )
    asyncio.run(engine.start())
    steps = engine.stepper  # type: ignore[attr-defined]
    assert isinstance(steps, FixedSteps) and len(steps.spans) == 2
    frames = getattr(engine, "frames", None) or getattr(getattr(engine, "steps", None), "frames", None)
    assert isinstance(frames, StaticFrames) == (stage == "talker" and example != "qwen2.5-omni")
    runs = [lambda span=span: steps._forward(steps.buckets[-1], span) for span in steps.spans]
    if frames is not None:
        runs.append(lambda: frames._frame(frames.buckets[-1]))
    with torch.inference_mode():
        for run in runs:
            run()
            with Dispatched() as seen, host_copies() as copies:
                run()
            assert sum(seen.ops.values()) > 50  # (the forward ran, every layer's operations seen)
            assert seen.waits == {} and copies == {}
