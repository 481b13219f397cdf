"""Our HTTP listeners: accepted connections get TCP_NODELAY (or every response can stall on a
40 ms delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from omni_pipeline.serving import listen


async def test_accepted_connections_have_nodelay() -> None:
    sock = listen("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_client(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = writer.get_extra_info("socket")
        accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_client, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_a_taken_port_is_refused_at_once() -> None:
    first = listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError):
            listen("127.0.0.1", port)
    finally:
        first.close()
