"""Producer-side flow control: what each request may still put for each consumer, and what is unread.

A consumer grants each request `credit` chunks per in-edge (the edge's `credit`, known to
both ends from the pipeline file, so the first chunks go without a round trip) and returns one
each time it reads a chunk. A producer with no credit left on an edge pauses that request
until some comes back, so a slow consumer slows its producer instead of filling the
connector. The bytes put and not yet read, summed over the replica's requests, are its
connector memory in use: at `maxUnreadBytes` the replica admits nothing new.

Plain and synchronous, like omni_stage.core: the process owns the waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Edge:
    credit: int
    unread: deque[int] = field(default_factory=deque)
    """Sizes of the chunks put and not yet read, oldest first (a consumer reads in order)."""


@dataclass(slots=True)
class _Account:
    deadline: float
    edges: dict[str, _Edge]
    open: bool = True


class CreditLedger:
    """One replica's credit and unread bytes, per request and consumer."""

    def __init__(self, grants: dict[str, int]) -> None:
        self.grants = dict(grants)
        """consumer stage -> the credit its in-edge from this stage grants each request."""
        self._accounts: dict[str, _Account] = {}
        self.unread_bytes = 0

    def open(self, request_id: str, deadline: float, consumers: list[str]) -> None:
        edges = {c: _Edge(self.grants[c]) for c in consumers}
        self._accounts[request_id] = _Account(deadline, edges)

    def available(self, request_id: str, consumer: str) -> int:
        return self._accounts[request_id].edges[consumer].credit

    def sent(self, request_id: str, consumer: str, nbytes: int) -> None:
        edge = self._accounts[request_id].edges[consumer]
        edge.credit -= 1
        edge.unread.append(nbytes)
        self.unread_bytes += nbytes

    def returned(self, request_id: str, consumer: str, chunks: int) -> bool:
        """A consumer read `chunks` chunks; False if the request or edge is not ours (late, or
        forged: credit for what was never sent is not added)."""
        account = self._accounts.get(request_id)
        edge = account.edges.get(consumer) if account is not None else None
        if account is None or edge is None:
            return False
        n = max(0, min(chunks, len(edge.unread)))
        for _ in range(n):
            self.unread_bytes -= edge.unread.popleft()
        edge.credit += n
        self._drop_if_done(request_id, account)
        return n > 0

    def close(self, request_id: str) -> None:
        """The request sent its last chunk: its account goes once its consumers have read it all."""
        if (account := self._accounts.get(request_id)) is not None:
            account.open = False
            self._drop_if_done(request_id, account)

    def forget(self, request_id: str) -> None:
        """The request failed or was aborted: its chunks are freed by the connectors' cleanup."""
        if (account := self._accounts.pop(request_id, None)) is not None:
            self.unread_bytes -= sum(sum(e.unread) for e in account.edges.values())

    def expire(self, now: float, keep: Container[str]) -> list[str]:
        """Forget requests past their deadline, but those in `keep` (still running: their own end
        forgets them): no consumer reads for them any more (a backstop for a lost abort)."""
        gone = [rid for rid, a in self._accounts.items() if a.deadline < now and rid not in keep]
        for rid in gone:
            self.forget(rid)
        return gone

    def tracked(self) -> int:
        return len(self._accounts)

    def _drop_if_done(self, request_id: str, account: _Account) -> None:
        if not account.open and not any(e.unread for e in account.edges.values()):
            del self._accounts[request_id]
