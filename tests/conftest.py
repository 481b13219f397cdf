"""Shared fixtures: a real nats-server and a real mooncake_master on loopback, the tiny demo models."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from filelock import FileLock

from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from omni_stage.demo import init_demo
from tests.deployment import Deployment, deployed, gauges, settle
from tests.helpers import ROOT

DONE = ".built"
VEC_ISA_OK: Final = "TORCHINDUCTOR_VEC_ISA_OK"
CPP_WRAPPER: Final = "TORCHINDUCTOR_CPP_WRAPPER"
UNOPTIMISED: Final = "TORCHINDUCTOR_DEBUG_COMPILE"
os.environ.setdefault(VEC_ISA_OK, "0")
os.environ.setdefault(CPP_WRAPPER, "1")
os.environ.setdefault(UNOPTIMISED, "1")
"""How inductor builds the suite's compiled forms (`one_compile_at_a_time` says why): scalar
C++ kernels (unless a run asks for vectorised ones, VEC_ISA_OK=1), each graph's kernels with
its C++ wrapper in one g++ run (unless CPP_WRAPPER=0), and that run unoptimised (g++ -O0 -g,
not -O3; unless DEBUG_COMPILE=0). Inductor reads them once, when first imported, and its
worker processes inherit them (setting only this process's config left the kernels
vectorised, checked): so set here, before any test module imports inductor (nothing above
does)."""
VLLM_MULTIPROCESSING: Final = "VLLM_ENABLE_V1_MULTIPROCESSING"
os.environ.setdefault(VLLM_MULTIPROCESSING, "0")
"""vLLM's engines in the suite as they run on a GPU: the engine core a process of its own, the
model's worker in it (vLLM's one-process executor). On the CPU vLLM otherwise gives the worker
a process of its own too (for OpenMP's sake, its CPU platform says; the suite runs one OpenMP
thread a process, and what it checks is the same either way), which imports vLLM and torch
and loads the model again: the vLLM modules (five engine starts) took 149 s of CPU and 2:13
with it, 125 s and 1:26 without. Nothing else an AsyncLLM runs reads it (but a warning about
its seed)."""


BENCH_MODULE: Final = "tests/e2e/test_bench.py"
SECONDS: Final = {
    # Compile-heavy (their compiled tests take turns on one lock): one first, one fifth, so that
    # the second reaches its compiled tests once the first is done with its own.
    "tests/unit/test_qwen3_omni.py": 10_000,
    "tests/integration/test_vllm.py": 9_000,
    "tests/e2e/test_serve.py": 8_000,
    "tests/e2e/test_qwen_omni.py": 7_000,
    "tests/unit/test_qwen_omni.py": 6_000,
    # The rest, longest first (a module's seconds in a full run, 2026-11-28, three workers).
    "tests/integration/test_gateway_schema.py": 100,  # half the examples since 2026-12-06
    "tests/e2e/test_qwen3_tts_clone.py": 130,
    "tests/e2e/test_qwen3_tts.py": 122,
    "tests/integration/test_vllm_qwen_omni.py": 120,
    "tests/unit/test_qwen3_tts.py": 107,
    "tests/faults/test_migration.py": 94,
    "tests/faults/test_disconnects.py": 88,
    "tests/e2e/test_kubernetes.py": 79,
    "tests/faults/test_connector_failures.py": 71,
    "tests/unit/test_image_edit.py": 65,
    "tests/e2e/test_videos.py": 64,
    "tests/integration/test_distributed.py": 58,
    "tests/e2e/test_image_edits.py": 55,
    "tests/faults/test_nats_restart.py": 47,
    "tests/e2e/test_sleep.py": 45,
    "tests/integration/test_stage_processes.py": 43,
    "tests/e2e/test_realtime.py": 43,
    "tests/integration/test_operator.py": 42,
    "tests/unit/test_qwen3_tts_clone.py": 41,
    "tests/integration/test_vllm_qwen3_omni.py": 41,
    "tests/faults/test_kill.py": 40,
    # The benchmarks since they fork their pipelines (2026-12-07, the thirtieth session's run).
    f"{BENCH_MODULE}::test_benchmark_prints_its_ratios_last[vllm-omni]": 54,
    f"{BENCH_MODULE}::test_benchmark_prints_its_ratios_last[image]": 48,
    f"{BENCH_MODULE}::test_benchmark_prints_its_ratios_last[qwen-omni]": 45,
    f"{BENCH_MODULE}::test_benchmark_prints_its_ratios_last[connectors]": 31,
}
"""Seconds a group (a module, or a benchmark) takes, roughly, where it is long: the groups start
longest first, so that the run ends on short ones (see pytest_collection_modifyitems)."""
UNLISTED: Final = {"process": 30, "unit": 5}
"""An unlisted group's guess: a module that starts processes, or a unit module."""


@pytest.hookimpl(trylast=True)
def pytest_collection_finish() -> None:
    """The collector back on once the tests are collected (pyproject.toml loads
    `omni_pipeline.collector_off` first): what collection imported (torch, transformers, some
    400k objects; with the collector on, a fifth of collection's CPU) frozen out of its sight,
    or every full collection of the models the tests build walks all of it again."""
    gc.freeze()
    gc.enable()


def pytest_xdist_setupnodes() -> None:
    """pytest-xdist's controller collects nothing: the collector back on before its workers start."""
    gc.enable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist each worker takes whole groups (`ModulesAndBenchmarks`) in this order:
    longest first (SECONDS), so that the many short groups fill the end of the run, where a slow
    one would keep one worker busy while the others idle (`make test` keeps this order:
    --no-loadscope-reorder). A worker takes its next group when its current one has two tests
    left, so the order is nearly the order groups start in."""

    def group(item: pytest.Item) -> str:
        path = item.nodeid.split("::", 1)[0]
        return item.nodeid if path == BENCH_MODULE else path

    def order(item: pytest.Item) -> tuple[int, str]:
        name = group(item)
        kind = "unit" if name.startswith("tests/unit/") else "process"
        return -SECONDS.get(name, UNLISTED[kind]), name

    items.sort(key=order)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole modules to a worker (a module's shared fixtures stay in one process), except the
    benchmarks, each a group of its own: together they would hold one worker for a quarter of
    an hour."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndBenchmarks(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module == BENCH_MODULE else module

    return ModulesAndBenchmarks(config, log)  # type: ignore[arg-type]


@pytest.fixture
def nats_url() -> Iterator[str]:
    """A real nats-server (`nats-server -a 127.0.0.1 -p -1`), its port read from its log."""
    server = EmbeddedNats()
    yield server.url
    server.stop()


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's base temporary directory: the workers' common parent under pytest-xdist."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture
def one_compile_at_a_time(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test that torch.compiles (its `form="compiled"` variant, where it has forms) waits here
    until no other worker of the run is compiling. Three at once on two cores took 389 s together
    against 238 s one after another (each compile's inductor workers and g++ jobs fight the
    others'), and the runs where they met were minutes longer (21:31 against 18:00, the same
    code: 447 s against 241 s for the three).

    Inductor builds scalar C++ kernels here, not vectorised ones, the kernels of a graph in
    one file with its C++ wrapper, and that file unoptimised (`VEC_ISA_OK`, `CPP_WRAPPER`,
    `UNOPTIMISED` above): what these tests hold (which forms compile, when, and that compiled
    output equals eager) does not depend on the kernels' instructions or on what calls them
    (the graphs, guards and kernels are the same; a GPU builds Triton kernels instead; the
    tests' tolerances are for fused kernels summing in another order, at either level), and g++ is much of
    their CPU: about 1.5 s a file, nearly all of it in the headers every kernel file includes,
    precompiled or not. Alone, with a cold cache, g++ counted: the compiled code2wav 135 s of
    CPU against 89 with the wrapper (45 g++ runs against 8), the two talkers 222 s against 135
    (89 runs against 18); unoptimised, the code2wav 71 s against 89 (BigVGAN's first graph
    was one g++ run of 17 s at -O3), the talkers 112 s against 117.

    Each starts with Dynamo as a fresh process has it (`torch._dynamo.reset`): Dynamo counts a
    code object's compiled forms against one limit for the process, and every transformers
    model's forward runs in one wrapper (docs/models.md, "Qwen3-Omni's compiled talker runs
    compiled"), so the Qwen3-Omni talker compiled before in the same worker left the
    Qwen2.5-Omni talker none to compile: its test passed uncompiled (2.8 s instead of a
    minute), found 2026-11-29. The tests now hold that the talker's start compiled something."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("form", "compiled") != "compiled":
        yield  # its eager and fixed forms compile nothing: they need no turn (they waited a minute)
        return
    import torch._dynamo
    import torch._inductor.config

    config = torch._inductor.config
    asked = (os.environ[VEC_ISA_OK] == "1", os.environ[CPP_WRAPPER] == "1")
    assert (config.cpp.vec_isa_ok, config.cpp_wrapper) == asked, "inductor was imported before conftest"
    with FileLock(str(_run_dir(tmp_path_factory) / "compile.lock")):
        torch._dynamo.reset()
        yield


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding models/ built by `omni models init-demo`, once per run: the
    pytest-xdist workers of one run share one (the first to ask builds it, under a file lock;
    the run's base temporary directory is the workers' common parent)."""
    root = _run_dir(tmp_path_factory)
    d = root / "demo"
    with FileLock(str(root / "demo.lock")):
        if not (d / DONE).exists():
            init_demo(d / "models")
            (d / DONE).touch()
    return d


@pytest.fixture
def mooncake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalMooncake]:
    """A real mooncake_master on loopback (with its HTTP metadata server) and one store server
    (mooncake_client) holding 256 MiB; omni processes are pure clients bound to 127.0.0.1."""
    mc = LocalMooncake(tmp_path)
    try:
        for k, v in mc.env().items():
            monkeypatch.setenv(k, v)
        yield mc
    finally:
        mc.stop()


@pytest.fixture
def synth_distributed(nats_url: str, mooncake: LocalMooncake, tmp_path: Path) -> Iterator[Deployment]:
    """tests/data/synthetic-distributed.yaml as separate processes: a thinker, two talkers (a,
    b), a vocoder and a gateway, tensors through Mooncake."""
    pipeline = ROOT / "tests" / "data" / "synthetic-distributed.yaml"
    with deployed(pipeline, {"thinker": 1, "talker": 2, "vocoder": 1}, 1, nats_url, ROOT, tmp_path) as d:
        yield d


@pytest.fixture
def leaves_base_as_it_found_it(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a module whose tests share one served pipeline (its `base` fixture) and open sockets
    to it: a test ends when every process behind `base` holds what it held before the test, so
    the next test's idle gauges count nothing of this one. (A socket's client returns from its
    close once the server has answered the close frame, before the server's handler and the
    connection's tasks have ended: read at once, the gateway counted one task more 1 time in 15.)"""
    if "base" not in request.fixturenames:
        yield
        return
    base = request.getfixturevalue("base")
    idle = gauges([base])
    yield
    settle([base], idle)
