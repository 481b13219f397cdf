"""What the gateway checks before a request reaches a route: the API key and the body's size.

Both are pure ASGI (BaseHTTPMiddleware would break streaming disconnects) and answer with
OpenAI's error body, like every other error of the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Final

import msgspec
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_gateway.errors import OmniError, PayloadTooLarge, Unauthorized
from omni_gateway.internal import ON_BEHALF_HEADER, internal_header
from omni_pipeline.settings import API_KEYS_ENV, API_KEYS_FILE_ENV

OPEN_PATHS: Final = frozenset({"/health", "/health/live", "/metrics", "/talk"})
"""Probes, Prometheus and a browser opening the talk page reach these without a key; they carry
no request data."""


class ApiKeyError(RuntimeError):
    """The API key configuration is unusable: the gateway refuses to start rather than run open."""


def load_api_keys() -> frozenset[str]:
    """Keys from OMNI_API_KEYS (comma-separated) and OMNI_API_KEYS_FILE (one per line, `#`
    comments); empty when neither is set, which turns authentication off."""
    keys = {k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()}
    if path := os.environ.get(API_KEYS_FILE_ENV):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ApiKeyError(f"{API_KEYS_FILE_ENV}={path}: {exc.strerror or exc}") from None
        from_file = {ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")}
        if not from_file:
            raise ApiKeyError(f"{API_KEYS_FILE_ENV}={path} holds no key")
        keys |= from_file
    return frozenset(keys)


async def _refuse(send: Send, err: OmniError, scope: str = "http") -> None:
    """OpenAI's error body with the error's status: an HTTP answer, or (`websocket.http`) the
    answer to a WebSocket upgrade."""
    body = msgspec.json.encode(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": f"{scope}.response.start", "status": err.status, "headers": headers})
    await send({"type": f"{scope}.response.body", "body": body})


WS_KEY_PROTOCOL: Final = b"openai-insecure-api-key."
"""A browser cannot set a socket's headers: it offers its key as a subprotocol (OpenAI's way)."""


async def _refuse_socket(scope: Scope, send: Send, err: OmniError) -> None:
    """Refuse a WebSocket upgrade with an HTTP answer where the server can send one; else a
    plain refusal (403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": err.message})
        return
    await _refuse(send, err, "websocket.http")


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every path but OPEN_PATHS, when keys are configured; on a
    WebSocket, the header or the `openai-insecure-api-key.<key>` subprotocol."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _allowed(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        ok = False
        for key in self.keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(token.strip(), key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        if scope["type"] == "websocket" and not header:
            offered = [p.encode() for p in scope.get("subprotocols", [])]
            header = next(
                (b"Bearer " + p[len(WS_KEY_PROTOCOL) :] for p in offered if p.startswith(WS_KEY_PROTOCOL)),
                b"",
            )
        if not self._allowed(header):
            msg = "missing or invalid API key: send 'Authorization: Bearer <key>'"
            err = Unauthorized(msg, headers={"WWW-Authenticate": "Bearer"})
            await (_refuse_socket(scope, send, err) if scope["type"] == "websocket" else _refuse(send, err))
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `max_bytes` (or a path's own limit in `larger`: a file upload)
    with 413: by Content-Length, or by reading the body here first (at most the limit of it)
    and handing it on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.max_bytes)
        err = PayloadTooLarge(f"request body over the gateway's limit of {limit} bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, err)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, err)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # after the body: disconnects, for streamed responses

        await self.app(scope, replay, send)


def owner_of(request: Request) -> str:
    """Whose jobs, files and batches the caller sees: its API key's (a digest of it), or
    everyone's when the gateway requires none; a batch line's, its batch's owner's."""
    if not request.app.state.api_keys_required:
        return ""
    if (owner := internal_header(request, ON_BEHALF_HEADER)) is not None:
        return owner  # a batch line's request: its batch's owner's
    token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32]
