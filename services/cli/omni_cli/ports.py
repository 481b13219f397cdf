"""Ports for a server that must be told its port before it starts (mooncake_master, a gateway
restarted on the port its clients know).

A port the kernel handed out for `bind(port 0)` and that was closed again is free only until
the next outgoing connection or `bind(0)` on the machine takes it from the same ephemeral range:
under a busy test run that happens between the pick and the server's own bind, and the server
exits (mooncake_master does so with status 1 and no word). These ports come from below that
range, where nothing is handed out without asking for it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Final

_EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST: Final = 10_000
"""Below this sit well-known services' ports (NATS 4222, 8080, ...)."""


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default start


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, outside the kernel's ephemeral range."""
    ceiling = _ephemeral_start()
    if ceiling <= _LOWEST + 1_000:
        raise RuntimeError(f"the ephemeral port range starts at {ceiling}: no ports are left below it")
    for _ in range(1_000):
        port = random.randrange(_LOWEST, ceiling)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use: another
            return port
    raise RuntimeError(f"no free port on {host} between {_LOWEST} and {ceiling}")
