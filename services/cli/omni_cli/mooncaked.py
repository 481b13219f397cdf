"""A local Mooncake store on loopback: mooncake_master (with its HTTP metadata server) and one
store server (mooncake_client) holding the data, for tests and benchmarks of the mooncake
connector on one machine. The binaries ship in the mooncake wheel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Final

import psutil

from omni_cli.ports import free_port
from omni_pipeline.connectors.mooncake import BIND_ENV, MASTER_ENV, METADATA_ENV
from omni_pipeline.lifecycle import die_with_parent

STORE_SERVES_S: Final = 10.0
"""How long a store server that has mounted its memory may take to serve its port: moments."""
INCOMPLETE_PUT_RELEASE_S: Final = 10
"""How long the master keeps an object whose writer died mid-put (it checks this often)."""
INCOMPLETE_PUT_FREED_S: Final = 3 * INCOMPLETE_PUT_RELEASE_S
"""A kill's unfinished put is gone from the store this soon after the kill (twice, and a margin)."""


class LocalMooncake:
    """mooncake_master and a store server of `store_bytes`, both on 127.0.0.1; logs in `log_dir`."""

    def __init__(
        self,
        log_dir: Path,
        store_bytes: int = 256 << 20,
        start_timeout_s: float = 30.0,
        store_port: int | None = None,
    ) -> None:
        """`store_port`: the store server's RPC port (a free one by default)."""
        rpc, meta, metrics = free_port(), free_port(), free_port()
        store = free_port() if store_port is None else store_port
        self.master = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{meta}/metadata"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        bindir = Path(sys.executable).parent
        self._logs: list[IO[str]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        try:
            self._master_cmd = (
                bindir / "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={meta}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
                # A writer killed mid-put leaves an incomplete object, which remove_by_regex skips
                # (it removes complete objects only): a new put of its key may replace it after
                # the discard timeout (30 s by default), and the master frees it on its own after
                # the release timeout (600 s by default; checked that often, so up to twice it).
                # A put on loopback takes milliseconds.
                "--put_start_discard_timeout_sec=5",
                f"--put_start_release_timeout_sec={INCOMPLETE_PUT_RELEASE_S}",
            )
            self._start(log_dir / "mooncake_master.log", *self._master_cmd)
            self._wait(lambda: self.key_count() == 0, start_timeout_s, "mooncake_master to serve")
            self._start(
                log_dir / "mooncake_store.log",
                bindir / "mooncake_client",
                "--host=127.0.0.1",
                f"--port={store}",
                f"--global_segment_size={store_bytes >> 20}MB",
                "--local_buffer_size=16MB",
                f"--master_server_address={self.master}",
                f"--metadata_server={self.metadata}",
                "--protocol=tcp",
            )
            self._wait(
                lambda: self.metric("master_total_capacity_bytes") >= store_bytes,
                start_timeout_s,
                "the store server's memory",
            )
            # It mounts its memory before it serves its port, and one that cannot (taken) keeps
            # running without serving: its memory stays mounted until the master misses its
            # heartbeats, 10 s later, and then every put finds no store server. So it must be
            # this process that listens there.
            self._wait(
                lambda: _listens(self._procs[1].pid, store),
                STORE_SERVES_S,
                f"the store server to serve :{store}",
            )
        except BaseException:
            self.stop()
            raise

    def restart_master(self, start_timeout_s: float = 30.0) -> None:
        """Kill mooncake_master and start it again on the same ports (a fault, for tests)."""
        self.kill_master()
        self.start_master(start_timeout_s)

    def kill_master(self) -> None:
        """SIGKILL mooncake_master (a fault, for tests): every key it knew of is gone with it."""
        self._procs[0].kill()
        self._procs[0].wait(10)

    def start_master(self, start_timeout_s: float = 30.0) -> None:
        """Start mooncake_master again on the same ports, after `kill_master`."""
        self._logs[0].close()
        self._logs[0] = Path(self._logs[0].name).with_suffix(".restarted.log").open("w")
        self._procs[0] = self._spawn(self._logs[0], *self._master_cmd)
        self._wait(lambda: self.key_count() == 0, start_timeout_s, "mooncake_master to serve again")

    def pause_master(self) -> None:
        """SIGSTOP mooncake_master (a fault, for tests: a stalled host). The kernel still
        accepts connections to it; nothing answers a call. Returns once it is stopped."""
        self._pause(self._procs[0])

    def resume_master(self) -> None:
        """SIGCONT mooncake_master: it answers what is still waiting, then new calls."""
        self._procs[0].send_signal(signal.SIGCONT)

    def pause_store_server(self) -> None:
        """SIGSTOP the store server (a fault, for tests: a stalled host). Its heartbeats stop;
        after the master's client TTL the master unmounts its memory, and puts find no room."""
        self._pause(self._procs[1])

    def resume_store_server(self) -> None:
        """SIGCONT the store server: at its next heartbeat it mounts its memory again."""
        self._procs[1].send_signal(signal.SIGCONT)

    def _pause(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGSTOP)

        def stopped() -> bool:
            return bool(psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED)

        self._wait(stopped, 10, "a SIGSTOP to land")

    def _start(self, log: Path, binary: Path, *args: str) -> None:
        self._logs.append(fh := log.open("w"))
        self._procs.append(self._spawn(fh, binary, *args))

    @staticmethod
    def _spawn(log: IO[str], binary: Path, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [str(binary), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, BIND_ENV: "127.0.0.1"},
            preexec_fn=die_with_parent,
        )

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc, log in zip(self._procs, self._logs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"waiting for {what}: {Path(proc.args[0]).name} exited with status "
                        f"{proc.returncode}; the end of {log.name}:\n{_tail(Path(log.name))}"
                    )
            try:
                if ready():
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)  # polling a process that has no readiness signal
        raise TimeoutError(f"timed out waiting for {what} (see {self._logs[-1].name})")

    def metric(self, name: str) -> int:
        """A counter or gauge from mooncake_master's Prometheus endpoint."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f"{name} "):
                    return int(float(line.split()[1]))
        raise KeyError(f"mooncake_master reports no {name}")

    def key_count(self) -> int:
        return self.metric("master_key_count")

    def env(self) -> dict[str, str]:
        """What omni processes need to use this store as pure clients bound to loopback."""
        return {MASTER_ENV: self.master, METADATA_ENV: self.metadata, BIND_ENV: "127.0.0.1"}

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for f in self._logs:
            f.close()


def _tail(log: Path, lines: int = 8) -> str:
    """The last lines of a log, for an error that says why a process ended."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({e})"


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on TCP `port` (not another that took the port)."""
    try:
        held = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in held)
