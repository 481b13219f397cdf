"""`WS /v1/realtime`: the socket a live session runs over, and the gateway's sessions; with
`?duplex=1` (or at `/v1/duplex`), vLLM-Omni's full-duplex dialect, whose session outlives its
socket (realtime/duplex.py).

The upgrade is refused (an HTTP answer, with OpenAI's error body) for another model's name or
when the replica holds its most sessions; API keys are checked before (guards.py). A session
ends when the client closes the socket (a duplex session: when it sends `session.close`, or
when its socket has been gone `resumeGraceS` without a resume), after `idleTimeoutS` without a
client event, after `maxSessionS`, or when the gateway shuts down (1001). Messages over the
gateway's request size limit close the socket (1009, the server's own check).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketState

from omni_gateway.errors import ModelNotFound, OmniError, Overloaded
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import BYTES_PER_MS
from omni_gateway.realtime.duplex import DuplexSession
from omni_gateway.realtime.duplex_protocol import DUPLEX_DECODER, DuplexSessionUpdate, SessionResume
from omni_gateway.realtime.link import Attachment, ResyncRequired
from omni_gateway.realtime.protocol import RealtimeError, client_event_id, new_id, parse_event
from omni_gateway.realtime.session import RealtimeSession

log = logging.getLogger("omni.gateway")

router = APIRouter()

SUBPROTOCOL: Final = "realtime"
"""What browsers offer beside their key (`openai-insecure-api-key.<key>`); chosen when offered."""
GOING_AWAY: Final = 1001
HANDSHAKE_S: Final = 10.0
"""A duplex socket's first message (session.update or session.resume) comes within this."""
_FALSE: Final = ("0", "false", "no", "off")


class LiveSessions:
    """The sessions a gateway replica holds, counted against its limit and closed at shutdown:
    GA sessions by their socket, duplex sessions by themselves (one whose socket has gone is
    held `grace_s` for a resume, then ended)."""

    def __init__(self, limit: int, grace_s: float, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.grace_s = grace_s
        self.metrics = metrics
        self.open: dict[str, WebSocket] = {}
        self.duplex: dict[str, DuplexSession] = {}
        self._expiry: dict[str, asyncio.Task[None]] = {}

    def full(self) -> bool:
        return len(self.open) + len(self.duplex) >= self.limit

    def awaiting_resume(self) -> bool:
        return any(s.socket is None for s in self.duplex.values())

    def add(self, session: DuplexSession) -> None:
        self.duplex[session.id] = session
        self.metrics.live_sessions.inc()

    def hold(self, session: DuplexSession) -> None:
        """Its socket has gone: ended after `grace_s` unless it is resumed."""
        self._expiry[session.id] = asyncio.get_running_loop().create_task(
            self._expire(session), name=f"expire-{session.id}"
        )

    def resumed(self, session: DuplexSession) -> None:
        if (expiry := self._expiry.pop(session.id, None)) is not None:
            expiry.cancel()

    async def _expire(self, session: DuplexSession) -> None:
        await asyncio.sleep(self.grace_s)  # a timer: the grace a dropped client has to come back
        self._expiry.pop(session.id, None)
        log.info("realtime %s: not resumed within %gs", session.id, self.grace_s)
        await self.end(session, "expired")

    async def end(self, session: DuplexSession, reason: str) -> None:
        """Free a duplex session (once): its response ended, the replicas let go of its kept
        sequence."""
        if self.duplex.pop(session.id, None) is None:
            return
        self.resumed(session)
        self.metrics.live_sessions.dec()
        await session.finish(reason)
        await session.close()
        log.info("realtime %s: ended (%s) after %d responses", session.id, reason, session.responses.count)

    async def close_all(self, reason: str) -> None:
        """Close every session's socket (1001, `reason`): at shutdown, before the server closes
        the connections still open (uvicorn's own close says 1012, and no reason)."""
        for ws in list(self.open.values()):
            with contextlib.suppress(Exception):  # one that has just gone
                await ws.close(GOING_AWAY, reason)
        for session in list(self.duplex.values()):
            socket = session.link.socket
            await self.end(session, "server_shutdown")
            if socket is not None:
                with contextlib.suppress(Exception):
                    await socket.close(GOING_AWAY, reason)


def _refusal(ws: WebSocket, pipeline: Pipeline, full: bool) -> OmniError | None:
    model = ws.query_params.get("model")
    if model is not None and model != pipeline.spec.served_model_name:
        return ModelNotFound(f"model '{model}' does not exist", param="model")
    if full:
        limit = pipeline.spec.gateway.realtime.max_sessions
        return Overloaded(
            f"this gateway replica holds its most live sessions ({limit}); try again later",
            headers={"Retry-After": "1"},
        )
    return None


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    if ws.query_params.get("duplex", "0").lower() not in _FALSE:
        await duplex(ws)
        return
    pipeline: Pipeline = ws.app.state.pipeline
    sessions: LiveSessions = ws.app.state.live_sessions
    limits = pipeline.spec.gateway
    if (refusal := _refusal(ws, pipeline, sessions.full())) is not None:
        await ws.send_denial_response(JSONResponse(refusal.body(), refusal.status, refusal.headers))
        return
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            if ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # closed under us
                    await ws.send_text(msgspec.json.encode(event).decode())

    metrics: GatewayMetrics = ws.app.state.metrics
    session = RealtimeSession(pipeline, send, _max_buffer(pipeline), metrics)
    sessions.open[session.id] = ws  # before the first await: the slot is this upgrade's
    metrics.live_sessions.inc()
    why = "closed by the client"
    try:
        await ws.accept(subprotocol=_subprotocol(ws))
        log.info("realtime %s: opened (%d live)", session.id, len(sessions.open))
        await session.open()
        end = time.monotonic() + limits.realtime.max_session_s
        why = await _serve(ws, session, lambda: limits.realtime.idle_timeout_s, end)
        if why != "closed by the client":
            await ws.close(1000, f"session {why}")
    finally:
        del sessions.open[session.id]
        metrics.live_sessions.dec()
        await session.close()
        log.info("realtime %s: %s after %d responses", session.id, why, session.responses.count)


@router.websocket("/v1/duplex")
async def duplex(ws: WebSocket) -> None:
    """A duplex session's socket: its first message opens a session (session.update, or any
    other event: the defaults, then that event) or resumes one (session.resume)."""
    pipeline: Pipeline = ws.app.state.pipeline
    sessions: LiveSessions = ws.app.state.live_sessions
    limits = pipeline.spec.gateway.realtime
    # A full replica still takes the upgrade while a session waits for its resume.
    full = sessions.full() and not sessions.awaiting_resume()
    if (refusal := _refusal(ws, pipeline, full)) is not None:
        await ws.send_denial_response(JSONResponse(refusal.body(), refusal.status, refusal.headers))
        return
    await ws.accept(subprotocol=_subprotocol(ws))
    socket = Attachment(send_text=ws.send_text, close=ws.close)
    session = await _duplex_handshake(ws, socket, sessions)
    if session is None:
        return
    why, lives_on = "failed", False
    try:
        why = await _serve(ws, session, lambda: session.idle_s, session.started + limits.max_session_s)
        if session.ended is None and why == "closed by the client":
            lives_on = _lives_on(session, socket, sessions)
    finally:  # a handler that fails ends its session, unless a resume moved it to another socket
        if not lives_on and (session.ended is not None or session.link.socket in (socket, None)):
            await sessions.end(session, session.ended or why)
    if not lives_on:
        with contextlib.suppress(Exception):  # the client's own close may have come first
            await ws.close(1000, f"session {session.ended}")


def _lives_on(session: DuplexSession, socket: Attachment, sessions: LiveSessions) -> bool:
    """The client went without `session.close`: the session goes on where a resume moved it,
    or waits for one (held); False when it cannot be resumed."""
    if session.link.socket is not None and session.link.socket is not socket:
        return True  # replaced by a resume: the session goes on there
    session.link.detach(socket)
    if not session.resumable or sessions.grace_s <= 0:
        return False
    log.info("realtime %s: its socket dropped; held %gs for a resume", session.id, sessions.grace_s)
    sessions.hold(session)
    return True


async def _duplex_handshake(
    ws: WebSocket, socket: Attachment, sessions: LiveSessions
) -> DuplexSession | None:
    """The session this socket serves, opened or resumed; None when refused (said, closed)."""
    pipeline: Pipeline = ws.app.state.pipeline
    metrics: GatewayMetrics = ws.app.state.metrics
    first: str | bytes | None = None
    if ws.query_params.get("autostart", "1").lower() in _FALSE or "model" not in ws.query_params:
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                message = await ws.receive()
        except TimeoutError:
            await _refuse(
                ws, f"no session.update or session.resume within {HANDSHAKE_S:g}s", "config_timeout"
            )
            return None
        if message["type"] == "websocket.disconnect":
            return None
        first = message.get("text") or message.get("bytes") or b""
    try:
        event = parse_event(first, DUPLEX_DECODER) if first is not None else None
        if isinstance(event, SessionResume):
            return await _resume(ws, socket, sessions, event, metrics)
        if sessions.full():
            raise RealtimeError(
                f"this gateway replica holds its most live sessions ({sessions.limit}); try again later",
                code="resource_exhausted",
            )
        session = DuplexSession(
            pipeline,
            _max_buffer(pipeline),
            metrics,
            pipeline.spec.gateway.realtime.resume_journal_bytes,
            pipeline.spec.gateway.realtime.idle_timeout_s,
        )
        if isinstance(event, DuplexSessionUpdate):
            await session.configure(event.session)
    except RealtimeError as exc:
        event_id = client_event_id(first) if first is not None else None
        await _refuse(ws, exc.message, exc.code, exc.param, event_id)
        return None
    sessions.add(session)
    log.info("realtime %s: duplex session opened (%d live)", session.id, len(sessions.duplex))
    try:
        await session.start(socket)
        if first is not None and not isinstance(event, DuplexSessionUpdate):
            await session.receive(first)
    except BaseException:  # a session that could not start holds nothing
        await sessions.end(session, "failed")
        raise
    return session


async def _resume(
    ws: WebSocket, socket: Attachment, sessions: LiveSessions, event: SessionResume, metrics: GatewayMetrics
) -> DuplexSession | None:
    session = sessions.duplex.get(event.session_id)
    if session is None or not session.resumable:
        raise RealtimeError(
            f"session_id: no session '{event.session_id}' to resume here (ended, or never opened)",
            code="session_resume_expired",
            param="session_id",
        )
    try:
        replaced = await session.resume(socket, event.resume_token, event.last_received_server_event_seq)
    except ResyncRequired:
        resync = {"type": "session.resync_required", "event_id": new_id("event"), "session_id": session.id}
        await ws.send_text(msgspec.json.encode({**resync, "reason": "journal_gap"}).decode())
        await ws.close(1000, "session resync required")
        return None
    sessions.resumed(session)
    metrics.resumes.inc()
    log.info("realtime %s: resumed (generation %d)", session.id, session.link.generation)
    if replaced is not None:
        replacement = {"type": "session.replaced", "event_id": new_id("event"), "session_id": session.id}
        with contextlib.suppress(Exception):  # it may be gone already
            await replaced.send_text(msgspec.json.encode(replacement).decode())
            await replaced.close(1000, "session replaced")
    return session


async def _refuse(
    ws: WebSocket, message: str, code: str, param: str | None = None, event_id: str | None = None
) -> None:
    """A socket that opens no session: an `error` event says why, then it closes (1008)."""
    kind = "rate_limit_error" if code == "resource_exhausted" else "invalid_request_error"
    error = {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}
    with contextlib.suppress(Exception):  # the client may be gone
        await ws.send_text(
            msgspec.json.encode({"type": "error", "event_id": new_id("event"), "error": error}).decode()
        )
        await ws.close(1013 if code == "resource_exhausted" else 1008, message[:120])


def _subprotocol(ws: WebSocket) -> str | None:
    return SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", []) else None


def _max_buffer(pipeline: Pipeline) -> int:
    return int(pipeline.spec.gateway.media.max_audio_seconds * 1000) * BYTES_PER_MS


async def _serve(
    ws: WebSocket, session: RealtimeSession | DuplexSession, idle_s: Callable[[], float], end: float
) -> str:
    """Take the client's events until the socket closes, the client ends the session, or a time
    limit (`idle_s()` without an event, or `end`, monotonic) ends it; returns why."""
    while session.ended is None:
        idle = idle_s()
        wait = min(idle, end - time.monotonic())
        try:
            async with asyncio.timeout(max(wait, 0)):
                message = await ws.receive()
        except TimeoutError:
            return "idle" if wait == idle else "at its time limit"
        if message["type"] == "websocket.disconnect":
            return "closed by the client"
        data = message.get("text")
        await session.receive(data if data is not None else message.get("bytes") or b"")
    return session.ended
