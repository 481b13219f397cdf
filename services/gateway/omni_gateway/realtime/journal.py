"""A full-duplex session's server events, numbered and kept until the client acknowledges them, so
that a client whose socket dropped resumes where it was: what it had not received is sent again,
in order. And the secret it resumes with.

The journal is bounded in bytes. A client that does not acknowledge (or stays away while a long
answer is spoken) fills it; the session then keeps going, but can no longer be resumed: the
client is told to resync (`session.resync_required`) and a later resume is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import deque
from typing import Any

import msgspec


class Journal:
    """Server events as sent (JSON text, each with its `server_event_seq`), oldest first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.head = 0
        """The last number given."""
        self._kept: deque[tuple[int, str]] = deque()
        self._bytes = 0
        self._acked = 0
        self.overflowed = max_bytes == 0

    def record(self, event: dict[str, Any]) -> str:
        """`event` numbered, as the socket sends it, and kept unless the journal has overflowed
        (this event may be what overflows it: `overflowed` says)."""
        self.head += 1
        text = msgspec.json.encode({**event, "server_event_seq": self.head}).decode()
        if not self.overflowed:
            if self._bytes + len(text) > self.max_bytes:
                self.overflowed = True
                self._kept.clear()
                self._bytes = 0
            else:
                self._kept.append((self.head, text))
                self._bytes += len(text)
        return text

    def acknowledge(self, seq: int) -> None:
        """The client has every event up to `seq`: they need not be kept."""
        if seq > self.head:
            raise ValueError(f"server_event_seq: {seq} is past the last event sent ({self.head})")
        self._acked = max(self._acked, seq)
        while self._kept and self._kept[0][0] <= seq:
            self._bytes -= len(self._kept.popleft()[1])

    def after(self, seq: int) -> list[str] | None:
        """The events after `seq`, to replay; None where they are not all kept (resync)."""
        if self.overflowed or seq < self._acked or seq > self.head:
            return None
        return [text for n, text in self._kept if n > seq]

    @property
    def kept_bytes(self) -> int:
        return self._bytes


class ResumeToken:
    """The secret a session is resumed with: given to the client on session.created and on each
    resume (a new one each time); only its digest is kept, and compared in constant time."""

    def __init__(self) -> None:
        self._digest = self._previous = b""

    def issue(self) -> str:
        token = secrets.token_urlsafe(32)
        self._previous, self._digest = self._digest, hashlib.sha256(token.encode()).digest()
        return token

    def matches(self, token: str) -> bool:
        return _same(token, self._digest)

    def matches_previous(self, token: str) -> bool:
        """The token issued before the last one."""
        return _same(token, self._previous)


def _same(token: str, digest: bytes) -> bool:
    return bool(digest) and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest)
