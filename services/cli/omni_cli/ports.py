"""Ports for a server that must be told its port before it starts (mooncake_master, a gateway
restarted on the port its clients know).

A port the kernel handed out for `bind(port 0)` and that was closed again is free only until
the next outgoing connection or `bind(0)` on the machine takes it from the same ephemeral range:
under a busy test run that happens between the pick and the server's own bind, and the server
exits (mooncake_master does so with status 1 and no word). These ports come from below that
range, where nothing is handed out without asking for it by number, and outside the ranges
Mooncake's clients pick their own ports from at random (a store client's 12300-14300, a transfer
engine's RPC and TCP transport 15000-17000): a store server told a port there once found it taken
by a stage's transfer engine between the pick and its bind, failed to serve it and left its
memory to the master, which dropped it 10 s later (tests/integration/test_mooncake.py).

A port handed out is leased on this machine for `LEASE_S` (a file named for it under
`omni-ports-UID/` in the temporary directory): no other caller gets it meanwhile, though nothing
listens there yet. Picks by random draw alone met: a LocalMooncake picks four ports at once and
its store server binds the last seconds later, a test restarts a gateway on the port its clients
know, and every pytest-xdist worker of a run picks its own.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Final

_EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST: Final = 10_000
"""Below this sit well-known services' ports (NATS 4222, 8080, ...)."""
MOONCAKE_RANDOM_PORTS: Final = (range(12_300, 14_301), range(15_000, 17_001))
"""Where Mooncake's clients bind ports of their own choosing (MC_STORE_CLIENT_MIN_PORT..MAX and
the transfer engine's rpc_min_port..rpc_max_port, their defaults)."""
LEASE_S: Final = 600.0
"""How long a port handed out is kept from other callers: longer than any server here takes
to bind what it was told, or a test to restart one on the same port."""
_LEASES: Final = Path(tempfile.gettempdir()) / f"omni-ports-{os.getuid()}"
"""One user's leases (another's directory would not be writable)."""


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default start


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, outside the kernel's ephemeral range, and that
    no caller on this machine was handed in the last `LEASE_S`; leased to this caller now."""
    ceiling = _ephemeral_start()
    if ceiling <= _LOWEST + 1_000:
        raise RuntimeError(f"the ephemeral port range starts at {ceiling}: no ports are left below it")
    _LEASES.mkdir(exist_ok=True)
    with (_LEASES / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file
        for _ in range(1_000):
            port = random.randrange(_LOWEST, ceiling)
            if any(port in taken for taken in MOONCAKE_RANDOM_PORTS) or _leased(port):
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # in use: another
            (_LEASES / str(port)).touch()
            return port
    raise RuntimeError(f"no free port on {host} between {_LOWEST} and {ceiling}")


def _leased(port: int) -> bool:
    try:
        return time.time() - (_LEASES / str(port)).stat().st_mtime < LEASE_S
    except FileNotFoundError:
        return False
