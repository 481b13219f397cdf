"""Shared fixtures: a real nats-server and a real mooncake_master on loopback, the tiny demo models."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from omni_cli.natsd import EmbeddedNats
from omni_pipeline.connectors.mooncake import BIND_ENV, MASTER_ENV, METADATA_ENV
from omni_stage.demo import init_demo
from tests.helpers import wait_for


@pytest.fixture
def nats_url() -> Iterator[str]:
    """A real nats-server (`nats-server -a 127.0.0.1 -p -1`), its port read from its log."""
    server = EmbeddedNats()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding models/ built by `omni models init-demo` (once per session)."""
    d = tmp_path_factory.mktemp("demo")
    init_demo(d / "models")
    return d


@dataclass(frozen=True)
class Mooncake:
    master: str
    metadata: str
    metrics: str

    def metric(self, name: str) -> int:
        for line in httpx.get(f"{self.metrics}/metrics", timeout=5).text.splitlines():
            if line.startswith(f"{name} "):
                return int(float(line.split()[1]))
        raise AssertionError(f"mooncake_master reports no {name}")

    def key_count(self) -> int:
        return self.metric("master_key_count")

    def env(self) -> dict[str, str]:
        return {MASTER_ENV: self.master, METADATA_ENV: self.metadata, BIND_ENV: "127.0.0.1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mooncake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Mooncake]:
    """A real mooncake_master on loopback (with its HTTP metadata server) and one store server
    (mooncake_client) holding 256 MiB; omni processes are pure clients bound to 127.0.0.1."""
    rpc, meta, metrics, store = _free_port(), _free_port(), _free_port(), _free_port()
    bindir = Path(sys.executable).parent
    mc = Mooncake(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata", f"http://127.0.0.1:{metrics}")
    logs = [(tmp_path / f"{n}.log").open("w") for n in ("mooncake_master", "mooncake_store")]
    procs = [
        subprocess.Popen(
            [
                str(bindir / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={meta}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
            ],
            stdout=logs[0],
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        wait_for(lambda: mc.key_count() == 0, 30, "mooncake_master to serve")
        procs.append(
            subprocess.Popen(
                [
                    str(bindir / "mooncake_client"),
                    "--host=127.0.0.1",
                    f"--port={store}",
                    "--global_segment_size=256MB",
                    "--local_buffer_size=16MB",
                    f"--master_server_address={mc.master}",
                    f"--metadata_server={mc.metadata}",
                    "--protocol=tcp",
                ],
                stdout=logs[1],
                stderr=subprocess.STDOUT,
                env={**os.environ, BIND_ENV: "127.0.0.1"},
            )
        )
        wait_for(
            lambda: mc.metric("master_total_capacity_bytes") >= 256 << 20, 30, "the store server's memory"
        )
        for k, v in mc.env().items():
            monkeypatch.setenv(k, v)
        yield mc
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
        for f in logs:
            f.close()
