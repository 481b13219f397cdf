"""Requests the gateway makes of itself, in its own process: an ASGI call through the whole app
(the same validation, errors and pipeline path as a client's request), with a key of the
process's own (`app.state.internal_key`, never shown) where clients need one. The batch runner
runs each batch line so; /v1/chat/completions/batch each conversation."""

from __future__ import annotations

from typing import Any

import httpx


def internal_client(app: Any) -> httpx.AsyncClient:
    """A client of `app` itself; no timeout of its own (the gateway's request deadline holds)."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://gateway",
        timeout=None,
        headers={"authorization": f"Bearer {app.state.internal_key}"},
    )
