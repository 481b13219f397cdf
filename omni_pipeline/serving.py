"""Running uvicorn inside our own processes, with signals handled by the process, not uvicorn.

Under `omni serve` a terminal's Ctrl-C reaches every process of the group; only the
supervisor acts on it and tells children to stop with SIGTERM. So children ignore SIGINT,
and a server embedded in them must not install handlers of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process that embeds it."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening now, so the caller knows its port before serving starts.

    Made with proto IPPROTO_TCP on purpose: asyncio sets TCP_NODELAY only on accepted sockets
    whose proto says TCP (socket.create_server's say 0), and without it every response that
    goes out in two writes waits out the client's 40 ms delayed ACK."""
    family, _, _, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def make_server(app: Any, **config: Any) -> EmbeddedServer:
    """Serve `app` on sockets the caller binds (so it knows the port before serving starts)."""
    return EmbeddedServer(uvicorn.Config(app, log_level="warning", **config))


def on_shutdown_signals(callback: Callable[[], None]) -> None:
    """Call `callback` on SIGTERM, and on SIGINT unless the parent told us to ignore it."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, callback)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGINT, callback)
