"""Requests the gateway makes of itself, in its own process: an ASGI call through the whole app
(the same validation, errors and pipeline path as a client's request), with a key of the
process's own (`app.state.internal_key`, never shown) where clients need one. The batch runner
runs each batch line so; /v1/chat/completions/batch each conversation.

Such a request may say whom it acts for and which id the job it makes takes (the headers
below); from any other caller those headers mean nothing."""

from __future__ import annotations

import hmac
from typing import Any, Final

import httpx
from starlette.requests import Request

ON_BEHALF_HEADER: Final = "x-omni-on-behalf-of"
"""The owner (omni_gateway.guards.owner_of) the request acts for: a batch line's video job is
its batch's owner's, to retrieve and download as any of theirs."""
JOB_ID_HEADER: Final = "x-omni-job-id"
"""The id of the job the request makes: the same each time a batch line runs, so a batch taken
up again finds the line's job instead of making another."""


def internal_client(app: Any) -> httpx.AsyncClient:
    """A client of `app` itself; no timeout of its own (the gateway's request deadline holds)."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://gateway",
        timeout=None,
        headers={"authorization": f"Bearer {app.state.internal_key}"},
    )


def _from_itself(request: Request) -> bool:
    """Whether the gateway made this request of itself (it carries the process's own key)."""
    token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(token.encode(), request.app.state.internal_key.encode())


def internal_header(request: Request, name: str) -> str | None:
    """Header `name` of a request the gateway made of itself; None from anyone else."""
    value = request.headers.get(name)
    return value if value is not None and _from_itself(request) else None
