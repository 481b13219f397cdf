"""The live replica table, fed by heartbeats; picks the least-loaded replica of a stage.

Entries are keyed by instance (one process's life), not by replica name: a replica restarted
under the same name is a new instance, and an old instance that is draining keeps its own entry
until it says it stopped, however the beats of the two interleave. An instance that said it
stopped, or that a successor showed to be dead, is retired: a late beat of its never brings it
back. One that only went quiet (expired, or not answering while it reconnects) comes back with
its next beat.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from omni_gateway.errors import Overloaded, Unavailable
from omni_pipeline.clips import ClipLimits
from omni_pipeline.control import HEARTBEAT_MISSES, Admitted, ErrorCode, Heartbeat

ASLEEP_RETRY_AFTER_S: Final = 10
"""Retry-After of a 503 for a stage that was put to sleep: it stays so until someone wakes it."""
RETIRED_KEPT: Final = 4096
"""Retired instance ids remembered (their late beats are ignored); the oldest are forgotten."""


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
    def serving(self) -> bool:
        """Takes new requests: neither draining, asleep nor, by its own word, unhealthy."""
        return not (self.hb.draining or self.hb.unhealthy or self.asleep)

    @property
    def asleep(self) -> bool:
        return self.hb.asleep is not None

    @property
    def room(self) -> bool:
        return self.load < self.hb.capacity + self.hb.max_queued


class ReplicaTable:
    def __init__(self, inbox: str) -> None:
        self.inbox = inbox
        self._by_stage: dict[str, dict[str, Replica]] = {}  # stage -> instance -> entry
        self._retired: OrderedDict[str, None] = OrderedDict()

    def update(self, hb: Heartbeat, now: float) -> list[Replica]:
        """Record a heartbeat; returns the instances it shows to be dead: an earlier instance of
        the same replica that was serving (not draining) cannot be alive beside its successor.

        A `stopping` beat only forgets its instance: it finished (or itself failed) every
        request it held before saying so, and those messages reach each gateway on its inbox,
        in their own time."""
        if hb.instance in self._retired:
            return []
        stage = self._by_stage.setdefault(hb.stage, {})
        if hb.stopping:
            self._retire(hb.instance)
            stage.pop(hb.instance, None)
            return []
        if (r := stage.get(hb.instance)) is not None:
            r.hb, r.last_seen = hb, now
            return []
        dead = [r for r in stage.values() if r.hb.replica == hb.replica and not r.hb.draining]
        for r in dead:
            self._retire(r.hb.instance)
            del stage[r.hb.instance]
        stage[hb.instance] = Replica(hb, now, self.inbox)
        return dead

    def _retire(self, instance: str) -> None:
        self._retired[instance] = None
        while len(self._retired) > RETIRED_KEPT:
            self._retired.popitem(last=False)

    def release(self, stage: str, instance: str) -> None:
        """This gateway's request is done with that instance (finished, failed or aborted)."""
        if (r := self._by_stage.get(stage, {}).get(instance)) is not None:
            r.ours = max(0, r.ours - 1)

    def remove(self, stage: str, instance: str) -> Replica | None:
        """Forget an instance for now (nothing answers on its subject). Not retired: it may only
        be reconnecting to NATS, and its next beat brings it back."""
        return self._by_stage.get(stage, {}).pop(instance, None)

    def heard_all(self, now: float) -> None:
        """Count missed heartbeats from `now` on (after a time we could not hear anyone)."""
        for stage in self._by_stage.values():
            for r in stage.values():
                r.last_seen = max(r.last_seen, now)

    def expire(self, now: float) -> list[Replica]:
        gone = []
        for stage in self._by_stage.values():
            for instance, r in list(stage.items()):
                if now - r.last_seen > r.hb.interval_s * HEARTBEAT_MISSES:  # (a late beat brings it back)
                    gone.append(stage.pop(instance))
        return gone

    def pick(self, stage: str, prefer: str | None = None) -> Replica:
        """The least loaded replica of `stage` with room; the instance `prefer` names where it
        serves and has room (it keeps a conversation's sequence)."""
        known = self._by_stage.get(stage, {}).values()
        live = [r for r in known if r.serving]
        if not live and self.asleep(stage):
            raise Unavailable(
                f"stage '{stage}' is asleep; POST /v1/omni/wakeup wakes it",
                code="stage_asleep",
                headers={"Retry-After": str(ASLEEP_RETRY_AFTER_S)},
            )
        if not live:
            sick = sorted({r.hb.unhealthy for r in known if r.hb.unhealthy and not r.hb.draining})
            why = f" (unhealthy: {'; '.join(sick)})" if sick else ""
            raise Unavailable(f"stage '{stage}' has no live replica{why}", headers={"Retry-After": "1"})
        best = self.choose(stage, prefer)
        if best is None:
            raise Overloaded(f"every replica of stage '{stage}' is full", headers={"Retry-After": "1"})
        best.ours += 1
        return best

    def choose(self, stage: str, prefer: str | None = None) -> Replica | None:
        """The replica `pick` would pick now, without taking a slot of it; None if none would
        do (none serving with room)."""
        open_ = [r for r in self._by_stage.get(stage, {}).values() if r.serving and r.room]
        return next((r for r in open_ if r.hb.instance == prefer), None) or min(
            open_, key=lambda r: (r.load / max(1, r.hb.capacity), r.hb.replica), default=None
        )

    def free(self, stage: str) -> int:
        """Slots free to run a request at once on the replicas of `stage` serving now (none
        queued behind what runs)."""
        known = self._by_stage.get(stage, {}).values()
        return sum(max(0, r.hb.capacity - r.load) for r in known if r.serving)

    def sick(self, stage: str) -> bool:
        """Every replica of `stage` that is not draining says it is unhealthy (and one does)."""
        up = [r for r in self._by_stage.get(stage, {}).values() if not r.hb.draining]
        return bool(up) and all(r.hb.unhealthy for r in up)

    def asleep(self, stage: str) -> bool:
        """Every replica of `stage` that is not draining was put to sleep (and one was)."""
        up = [r for r in self._by_stage.get(stage, {}).values() if not r.hb.draining]
        return bool(up) and all(r.asleep for r in up)

    def covers(self, stages: list[str]) -> bool:
        """Each stage has a replica serving or asleep (up, and doing as it was told)."""
        return all(any(r.serving or r.asleep for r in self._by_stage.get(s, {}).values()) for s in stages)

    def up(self, stages: list[str]) -> list[Replica]:
        """The replicas of `stages` that are not draining (what a sleep or wake is sent to)."""
        return [r for s in stages for r in self._by_stage.get(s, {}).values() if not r.hb.draining]

    def declared(
        self, stage: str, what: Literal["accepts", "honours", "voices", "languages"]
    ) -> frozenset[str] | None:
        """What the stage's engine reads (`accepts`: content part kinds), honours (`honours`:
        request parameters) or speaks in (`voices`, `languages`), as its replicas declare it (all
        run one engine); None while none has."""
        for r in self._by_stage.get(stage, {}).values():
            if (declared := getattr(r.hb, what)) is not None:
                return frozenset(declared)
        return None

    def clip_limits(self, stage: str) -> ClipLimits | None:
        """What the stage can make of a video, as its replicas declare it; None where none has."""
        return next(
            (r.hb.clip_limits for r in self._by_stage.get(stage, {}).values() if r.hb.clip_limits), None
        )

    def encodes_audio_ahead(self, stage: str) -> bool:
        """Whether the stage's replicas encode a live session's audio as it arrives."""
        return any(r.hb.audio_ahead for r in self._by_stage.get(stage, {}).values())

    def tokenizes(self, stage: str) -> bool | None:
        """Whether the stage answers /tokenize, as its replicas declare it; None while none has."""
        return next(
            (r.hb.tokenizes for r in self._by_stage.get(stage, {}).values() if r.hb.tokenizes is not None),
            None,
        )

    def refused(self, stage: str, instance: str, answer: Admitted) -> None:
        """A replica refused a request for its own state (unhealthy, draining), which its next
        beat would have told us: believe it now, so that a retry goes elsewhere, or is a 503
        that says why, instead of asking it again. Its next beat has the last word."""
        r = self._by_stage.get(stage, {}).get(instance)
        if r is not None and answer.code == ErrorCode.UNHEALTHY:
            r.hb = msgspec.structs.replace(r.hb, unhealthy=answer.unhealthy or answer.message)
        elif r is not None and answer.code == ErrorCode.DRAINING:
            r.hb = msgspec.structs.replace(r.hb, draining=True)
        elif r is not None and answer.code == ErrorCode.SLEEPING and r.hb.asleep is None:
            r.hb = msgspec.structs.replace(r.hb, asleep=0)  # its level comes with its next beat

    def get(self, stage: str, instance: str) -> Replica | None:
        return self._by_stage.get(stage, {}).get(instance)

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
                "unhealthy": r.hb.unhealthy,
                "asleep": r.hb.asleep,
                "metrics_port": r.hb.metrics_port,
            }
            for stage in self._by_stage.values()
            for r in stage.values()
        ]
