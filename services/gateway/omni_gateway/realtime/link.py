"""A full-duplex session's link to its client, which outlives any one socket: every event
numbered and journaled (journal.py), sent to the socket attached now if one is, and replayed,
in order, onto the socket that resumes the session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from omni_gateway.realtime.journal import Journal, ResumeToken
from omni_gateway.realtime.protocol import RealtimeError, new_id

Hello = Callable[[str, int], dict[str, Any]]
"""The handshake event (session.created, session.resumed) for a new token and generation."""


@dataclass(eq=False)
class Attachment:
    """The socket a session is sent over now; a resume gives it a new one."""

    send_text: Callable[[str], Awaitable[None]]
    close: Callable[[int, str], Awaitable[None]]
    generation: int = 0


class ResyncRequired(Exception):
    """The journal no longer holds every event the resuming client missed."""


class Link:
    """One session's events to its client, across the sockets it is attached over in turn."""

    def __init__(self, session_id: str, journal_bytes: int) -> None:
        self.session_id = session_id
        self.journal = Journal(journal_bytes)
        self.token = ResumeToken()
        self.socket: Attachment | None = None
        self.generation = 0
        self._lock = asyncio.Lock()
        """One sender at a time, and none while a resume swaps the socket and replays."""
        self._told_resync = False

    async def attach(self, socket: Attachment, hello: Hello) -> None:
        """The first socket: its handshake carries the token to resume with (not journaled: a
        client that missed it has no token to resume with)."""
        self.generation = socket.generation = 1
        self.socket = socket
        async with self._lock:
            await self._to_socket(self._handshake(hello))

    async def resume(self, socket: Attachment, token: str, last_seq: int, hello: Hello) -> Attachment | None:
        """Move onto `socket`: its handshake (a new token), then every event after `last_seq`, in
        order; returns the socket it replaced, if one was still attached. The token before the
        last still resumes while no socket is attached: the socket its successor went out on
        may have dropped before the client read it."""
        current = self.token.matches(token)
        if not (current or (self.socket is None and self.token.matches_previous(token))):
            raise RealtimeError(
                "resume_token: not this session's", code="invalid_resume_token", param="resume_token"
            )
        async with self._lock:
            missed = self.journal.after(last_seq)
            if missed is None:
                raise ResyncRequired
            replaced, self.socket = self.socket, socket
            self.generation += 1
            socket.generation = self.generation
            await self._to_socket(self._handshake(hello))
            for text in missed:
                await self._to_socket(text)
        return replaced

    def detach(self, socket: Attachment) -> bool:
        """`socket` has gone; True if the link was on it (and now waits for a resume)."""
        if self.socket is not socket:
            return False
        self.socket = None
        return True

    async def deliver(self, event: dict[str, Any]) -> None:
        """One event: numbered and journaled, then sent if a socket is there."""
        async with self._lock:
            text = self.journal.record(event)
            if self.journal.overflowed and not self._told_resync:
                self._told_resync = True
                resync = {
                    "type": "session.resync_required",
                    "event_id": new_id("event"),
                    "session_id": self.session_id,
                    "reason": "journal_overflow",
                }
                await self._to_socket(msgspec.json.encode(resync).decode())
            await self._to_socket(text)

    def _handshake(self, hello: Hello) -> str:
        return msgspec.json.encode(hello(self.token.issue(), self.generation)).decode()

    async def _to_socket(self, text: str) -> None:
        socket = self.socket
        if socket is None:
            return
        try:
            await socket.send_text(text)
        except Exception:  # it has gone: kept in the journal, for a resume
            self.detach(socket)
