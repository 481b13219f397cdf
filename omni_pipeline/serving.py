"""Running uvicorn inside our own processes, with signals handled by the process, not uvicorn.

Under `omni serve` a terminal's Ctrl-C reaches every process of the group; only the
supervisor acts on it and tells children to stop with SIGTERM. So children ignore SIGINT,
and a server embedded in them must not install handlers of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process that embeds it."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def make_server(app: Any, **config: Any) -> EmbeddedServer:
    """Serve `app` on sockets the caller binds (so it knows the port before serving starts)."""
    return EmbeddedServer(uvicorn.Config(app, log_level="warning", **config))


def on_shutdown_signals(callback: Callable[[], None]) -> None:
    """Call `callback` on SIGTERM, and on SIGINT unless the parent told us to ignore it."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, callback)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGINT, callback)
