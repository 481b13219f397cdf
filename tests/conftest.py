"""Shared fixtures: a real nats-server and a real mooncake_master on loopback, the tiny demo models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from filelock import FileLock

from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from omni_stage.demo import init_demo
from tests.deployment import Deployment, deployed
from tests.helpers import ROOT

DONE = ".built"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The unit tests last. Under pytest-xdist each worker takes whole modules in this order:
    the slow modules that start processes begin early, and the many short unit modules fill the
    end of the run, where a slow one would keep one worker busy while the others idle."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/unit/"))


@pytest.fixture
def nats_url() -> Iterator[str]:
    """A real nats-server (`nats-server -a 127.0.0.1 -p -1`), its port read from its log."""
    server = EmbeddedNats()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding models/ built by `omni models init-demo`, once per run: the
    pytest-xdist workers of one run share one (the first to ask builds it, under a file lock;
    the run's base temporary directory is the workers' common parent)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
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
