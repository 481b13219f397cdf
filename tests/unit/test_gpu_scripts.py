"""The GPU scripts run on this CPU at the demo's sizes, as scripts/gpu_run.sh runs them on a lent
GPU: a task is lent a GPU by chance, for minutes, and those are not to be spent finding that a
script no longer fits the code it drives. On a CPU nothing is captured: `cudaGraphs` becomes
`fixedSteps`, the same steps at the same fixed shapes, uncaptured. What only a GPU shows (that
the captures take, their codes, their times) is the scripts' own to measure there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

BATCHES = (1, 2)


def run_script(script: str, out: Path, *args: str) -> dict[str, Any]:
    """`scripts/SCRIPT OUT ARGS` as gpu_run.sh runs it (the project on PYTHONPATH, nothing installed)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'services' / 'stage_worker'}"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_gpu_graphs_compares_the_talkers_frames_and_steps(tmp_path: Path) -> None:
    """Qwen3-Omni's talker: its code predictor's frames and its decode steps, the stage's against
    the same uncaptured (here both uncaptured: equal to the bit), by batch size."""
    found = run_script(
        "gpu_graphs.py",
        tmp_path / "graphs.json",
        *("--device", "cpu", "--sizes", "tiny", "--frames", "2", "--model-dir", str(tmp_path / "model")),
        *("--batches", *map(str, BATCHES)),
    )
    assert (found["device"], found["captured"], found["decode_steps"]["steps_captured"]) == (
        "cpu",
        False,
        False,
    )
    for frames_or_steps in (found["batches"], found["decode_steps"]["batches"]):
        assert sorted(frames_or_steps) == [str(n) for n in BATCHES]
        assert all(b["graphed_equals_eager"] and b["graphed_ms"] > 0 for b in frames_or_steps.values())


@pytest.mark.parametrize("pipeline", ["qwen3-omni", "qwen3-tts"])
def test_gpu_bench_serves_each_pipeline_with_its_steps_graphed(pipeline: str, tmp_path: Path) -> None:
    """Every speaking step of the graphed configuration (`--cuda-graphs`) at fixed shapes, none on
    the table's own, and every request spoken. (Qwen2.5-Omni takes the script's path Qwen3-Omni
    takes, another family's checkpoint and stages: 10 s more of the suite for no line more.)"""
    found = run_script(
        "gpu_bench.py",
        tmp_path / "bench.json",
        *("--pipeline", pipeline, "--sizes", "tiny", "--device", "cpu", "--cuda-graphs"),
        *("--concurrency", "2", "--tokens", "8", "--codes", "13", "--model-dir", str(tmp_path / "models")),
    )
    stepping = ["talker"] if pipeline == "qwen3-tts" else ["thinker", "talker"]
    assert found["captured"] == dict.fromkeys(stepping, False)
    assert {s: set(ran) for s, ran in found["slot_steps"].items()} == {s: {"fixed"} for s in stepping}
    [c2] = found["runs"]
    assert (c2["concurrency"], c2["requests"]) == (2, 2) and c2["audio_s"] > 0
