"""The live replica table, fed by heartbeats; picks the least-loaded replica of a stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_gateway.errors import Overloaded, Unavailable
from omni_pipeline.control import HEARTBEAT_MISSES, Heartbeat


@dataclass(slots=True)
class Replica:
    hb: Heartbeat
    last_seen: float
    inbox: str
    """Our gateway's inbox: how the heartbeat names our share of its load."""
    ours: int = 0
    """Requests this gateway has on this replica now: routed there, its part not yet done."""

    @property
    def load(self) -> int:
        """The other gateways' requests as of the last beat, plus ours as of now. (The beat lags
        by up to an interval; ours never do, even when many ended since it was sent.)"""
        theirs = self.hb.queued + self.hb.inflight - self.hb.by_gateway.get(self.inbox, 0)
        return max(0, theirs) + self.ours

    @property
    def room(self) -> bool:
        return self.load < self.hb.capacity + self.hb.max_queued


class ReplicaTable:
    def __init__(self, inbox: str) -> None:
        self.inbox = inbox
        self._by_stage: dict[str, dict[str, Replica]] = {}

    def update(self, hb: Heartbeat, now: float) -> Replica | None:
        """Record a heartbeat; returns the entry it replaces if that was another instance."""
        stage = self._by_stage.setdefault(hb.stage, {})
        old = stage.get(hb.replica)
        if hb.stopping:
            return stage.pop(hb.replica, None)
        restarted = old is not None and old.hb.instance != hb.instance
        ours = old.ours if old is not None and not restarted else 0
        stage[hb.replica] = Replica(hb, now, self.inbox, ours)
        return old if restarted else None

    def release(self, stage: str, replica: str, instance: str) -> None:
        """This gateway's request is done with that replica (finished, failed or aborted)."""
        r = self._by_stage.get(stage, {}).get(replica)
        if r is not None and r.hb.instance == instance:
            r.ours = max(0, r.ours - 1)

    def remove(self, stage: str, replica: str) -> Replica | None:
        """Forget a replica at once (it answered no request: it is gone)."""
        return self._by_stage.get(stage, {}).pop(replica, None)

    def heard_all(self, now: float) -> None:
        """Count missed heartbeats from `now` on (after a time we could not hear anyone)."""
        for stage in self._by_stage.values():
            for r in stage.values():
                r.last_seen = max(r.last_seen, now)

    def expire(self, now: float) -> list[Replica]:
        gone = []
        for stage in self._by_stage.values():
            for rid, r in list(stage.items()):
                if now - r.last_seen > r.hb.interval_s * HEARTBEAT_MISSES:
                    gone.append(stage.pop(rid))
        return gone

    def pick(self, stage: str) -> Replica:
        live = [r for r in self._by_stage.get(stage, {}).values() if not r.hb.draining]
        if not live:
            raise Unavailable(f"stage '{stage}' has no live replica", headers={"Retry-After": "1"})
        open_ = [r for r in live if r.room]
        if not open_:
            raise Overloaded(f"every replica of stage '{stage}' is full", headers={"Retry-After": "1"})
        best = min(open_, key=lambda r: (r.load / max(1, r.hb.capacity), r.hb.replica))
        best.ours += 1
        return best

    def covers(self, stages: list[str]) -> bool:
        return all(any(not r.hb.draining for r in self._by_stage.get(s, {}).values()) for s in stages)

    def get(self, stage: str, replica: str) -> Replica | None:
        return self._by_stage.get(stage, {}).get(replica)

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "stage": r.hb.stage,
                "replica": r.hb.replica,
                "instance": r.hb.instance,
                "pid": r.hb.pid,
                "host": r.hb.host,
                "queued": r.hb.queued,
                "inflight": r.hb.inflight,
                "capacity": r.hb.capacity,
                "draining": r.hb.draining,
                "metrics_port": r.hb.metrics_port,
            }
            for stage in self._by_stage.values()
            for r in stage.values()
        ]
