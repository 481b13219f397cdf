"""`omni bench NAME --quick --json`: every benchmark runs end to end against the real processes
and prints its JSON object, with the ratios the benchmark issue names, as the last line of its
standard output. The command line's own main, forked from the tests' server (omni_cli.forked);
the pipelines it serves are forked from it, as a user's are (bench/procs.py).
--quick runs a couple of rounds: this checks that the benchmarks work, never how fast."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from bench.procs import DEMO_DIR_ENV
from omni_cli.forked import ForkedProcess
from tests.helpers import OMNI, ROOT, ended, wait_for

BENCH_TIMEOUT_S = 600
"""A benchmark's --quick run starts whole pipelines (three, for epd): under a full suite's load
each takes up to 160 s, and a third of the timeout is kept free."""
RATIOS = {
    "batch": {"batch_vs_online", "live_ttfp_during_batch_vs_idle"},
    "connectors": {"shm_64MiB_vs_memcpy", "mooncake_64MiB_vs_raw", "shm_64MiB_vs_queue_pickle"},
    "epd": {"thinker_throughput_split_vs_in_thinker", "e2e_split_vs_in_thinker", "encoder_replicas_2_vs_1"},
    "hop": {"p50_vs_raw_nats"},
    "pipeline": {"throughput_vs_ideal", "bottleneck_2_replicas_speedup"},
    "streaming": {"ttfa_window_vs_full"},
    "gateway": {"added_latency_p50_ms"},
    "qwen-omni": {
        "ttfp_window_vs_full",
        "throughput_c8_vs_c1",
        "c8_batched_vs_unbatched",
        "streamed_vs_whole_throughput_c1",
        "rtf_c8",
        "ttfp_c8_vs_c1",
        "ttfp_c1_smallest_vs_12",
        "c8_load_sized_vs_12",
    },
    "realtime": {"first_audio_10s_vs_2s", "first_audio_turn5_vs_turn1"},
    "step": {
        f"host_share_{model}_{kind}_b{batch}"
        for model, kinds in (
            ("qwen2.5-omni", ("decode", "decode_fixed")),
            ("qwen3-omni", ("decode", "residuals", "decode_fixed")),
            ("qwen3-tts", ("frame", "frame_fixed")),
        )
        for kind in kinds
        for batch in (1, 8)
    },
    "prompts": {
        f"{k}_{m}" for k in ("compute_outside_calls", "ttft_c8_vs_c1") for m in ("qwen2.5-omni", "qwen3-omni")
    },
    "sleep": {"tiny-omni_rss_asleep_vs_awake_min", "tiny-omni_rss_asleep_vs_awake_max"},
    "tts": {
        "c1_whole_vs_reference",
        "c1_first_audio_vs_reference",
        "c8_vs_reference_batched",
        "throughput_c8_vs_c1",
        "rtf_c1",
        "rtf_c8",
    },
    "video": {"sync_vs_diffusers", "job_c1_vs_diffusers", "jobs_c2_vs_c1"},
    "image": {"edit_c1_vs_diffusers", "edits_c4_vs_c1", "generations_c4_vs_c1"},
    "vllm-omni": {f"{m}_c{c}" for m in ("ttft", "tpot", "ttfp", "rtf") for c in (1, 4)},
}


@pytest.mark.timeout(BENCH_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(RATIOS))
def test_benchmark_prints_its_ratios_last(name: str, demo_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, DEMO_DIR_ENV: str(demo_dir)}  # the session's demo models, not one per benchmark
    log, stdout = tmp_path / "bench.log", tmp_path / "bench.out"
    bench = ForkedProcess(["bench", name, "--quick", "--json"], ROOT, env, log, stdout)
    try:
        code = bench.wait(BENCH_TIMEOUT_S - 30)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
    assert code == 0, log.read_text()[-3000:]
    result = json.loads(stdout.read_text().strip().splitlines()[-1])
    assert result["benchmark"] == name and result["machine"]["cores"] >= 1
    assert RATIOS[name] <= set(result["ratios"])
    for key, value in result["ratios"].items():
        assert isinstance(value, int | float) and math.isfinite(value), (key, value)
        # A share of a step: its forwards are timed inside the steps they are counted with
        # (padded to a bucket, a forward is still its step's, not the bucket's size's).
        assert not key.startswith("host_share_") or 0 <= value < 1, (key, value)


def test_bench_lists_the_benchmarks() -> None:
    out = subprocess.run([*OMNI, "bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    listed = out.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert len(listed) == len(set(listed)) and RATIOS.keys() <= set(listed)
    assert not any("_" in name for name in listed), listed  # one spelling each: qwen-omni, not qwen_omni


def test_a_benchmark_killed_takes_its_pipeline_with_it(demo_dir: Path, tmp_path: Path) -> None:
    """SIGKILL of `omni bench` (it runs no `finally`) while it serves a pipeline: the pipeline's
    `omni serve`, forked from the benchmark's fork server, ends with that server, and the
    server with the benchmark, and every process the serve started with it."""
    env = {**os.environ, DEMO_DIR_ENV: str(demo_dir)}
    bench = ForkedProcess(["bench", "pipeline", "--quick", "--json"], ROOT, env, tmp_path / "bench.log")
    try:

        def serving() -> list[psutil.Process]:
            tree = psutil.Process(bench.pid).children(recursive=True)
            titles = {next(iter(p.cmdline()), "") for p in tree}  # a process gone meanwhile: asked again
            return tree if {"omni: supervisor bench", "omni: gateway"} <= titles else []

        tree = wait_for(serving, 120, "the benchmark's first pipeline to serve")
    finally:
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(10)
    try:
        wait_for(lambda: all(ended(p.pid) for p in tree), 60, "the pipeline to end with its benchmark")
    finally:  # a failure leaves nothing running either
        for left in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                left.kill()
