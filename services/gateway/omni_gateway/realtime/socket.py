"""`WS /v1/realtime`: the socket a live session runs over, and the gateway's sessions.

The upgrade is refused (an HTTP answer, with OpenAI's error body) for another model's name or
when the replica holds its most sessions; API keys are checked before (guards.py). A session
ends when the client closes the socket, after `idleTimeoutS` without a client event, after
`maxSessionS`, or when the gateway shuts down (1001). Messages over the gateway's request size
limit close the socket (1009, the server's own check).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Final

import msgspec
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketState

from omni_gateway.errors import ModelNotFound, OmniError, Overloaded
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import BYTES_PER_MS
from omni_gateway.realtime.session import RealtimeSession

log = logging.getLogger("omni.gateway")

router = APIRouter()

SUBPROTOCOL: Final = "realtime"
"""What browsers offer beside their key (`openai-insecure-api-key.<key>`); chosen when offered."""
GOING_AWAY: Final = 1001


class LiveSessions:
    """The sessions a gateway replica holds: counted against its limit, closed at shutdown."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, WebSocket] = {}
        self._closing: asyncio.Task[None] | None = None

    def full(self) -> bool:
        return len(self.open) >= self.limit

    def close_all(self, reason: str) -> None:
        """Close every session's socket (1001, `reason`), from a task: called from a signal's
        handler, before the server closes its connections."""
        self._closing = asyncio.get_running_loop().create_task(
            self._close_all(reason), name="close-live-sessions"
        )

    async def _close_all(self, reason: str) -> None:
        for ws in list(self.open.values()):
            with contextlib.suppress(Exception):  # one that has just gone
                await ws.close(GOING_AWAY, reason)


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    pipeline: Pipeline = ws.app.state.pipeline
    sessions: LiveSessions = ws.app.state.live_sessions
    limits = pipeline.spec.gateway
    model = ws.query_params.get("model")
    refusal: OmniError | None = None
    if model is not None and model != pipeline.spec.served_model_name:
        refusal = ModelNotFound(f"model '{model}' does not exist", param="model")
    elif sessions.full():
        refusal = Overloaded(
            f"this gateway replica holds its most live sessions ({sessions.limit}); try again later",
            headers={"Retry-After": "1"},
        )
    if refusal is not None:
        await ws.send_denial_response(JSONResponse(refusal.body(), refusal.status, refusal.headers))
        return
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            if ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # closed under us
                    await ws.send_text(msgspec.json.encode(event).decode())

    max_buffer = int(limits.media.max_audio_seconds * 1000) * BYTES_PER_MS
    metrics: GatewayMetrics = ws.app.state.metrics
    session = RealtimeSession(pipeline, send, max_buffer, metrics)
    sessions.open[session.id] = ws  # before the first await: the slot is this upgrade's
    metrics.live_sessions.inc()
    why = "closed by the client"
    try:
        offered = ws.scope.get("subprotocols", [])
        await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        log.info("realtime %s: opened (%d live)", session.id, len(sessions.open))
        await session.open()
        why = await _serve(ws, session, limits.realtime.idle_timeout_s, limits.realtime.max_session_s)
    finally:
        del sessions.open[session.id]
        metrics.live_sessions.dec()
        await session.close()
        log.info("realtime %s: %s after %d responses", session.id, why, session.responses.count)


async def _serve(ws: WebSocket, session: RealtimeSession, idle_s: float, most_s: float) -> str:
    """Take the client's events until the socket closes or a time limit ends the session."""
    end = time.monotonic() + most_s
    while True:
        wait = min(idle_s, end - time.monotonic())
        try:
            async with asyncio.timeout(max(wait, 0)):
                message = await ws.receive()
        except TimeoutError:
            why = "idle" if wait == idle_s else "at its time limit"
            await ws.close(1000, f"session {why}")
            return why
        if message["type"] == "websocket.disconnect":
            return "closed by the client"
        data = message.get("text")
        await session.receive(data if data is not None else message.get("bytes") or b"")
