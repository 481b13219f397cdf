"""A replica's state, owned by one object: where it is in its life (`Phase`), with every way from
one phase to another in one table (`TRANSITIONS`), and beside the phase its health.

Plain and synchronous (no NATS, no loop), like the core that reads it: admission refuses by it,
readiness and the heartbeat report it, the sleep control and the process's signals change it,
and only through `change`, which refuses a move the table does not have.

Health is not a phase: a connector's backend that goes down makes any replica, ready or asleep,
take nothing new until it answers again, and a replica asleep stays asleep (and is reported so)
while it is unhealthy, so that a wake reaches it. It is one field of the same object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class Phase(enum.StrEnum):
    STARTING = "starting"
    """Loading its engine; admits nothing yet."""
    READY = "ready"
    SLEEPING = "sleeping"
    """Put to sleep at a level (vLLM's): admits nothing until woken."""
    DRAINING = "draining"
    """Told to stop: finishes what it holds, admits nothing new, then exits."""
    DEAD = "dead"
    """Its engine can serve nothing more: it fails what it holds and exits, to be restarted."""


class Change(enum.StrEnum):
    SERVE = "serve"
    """The engine has loaded (and the replica is connected)."""
    SLEEP = "sleep"
    WAKE = "wake"
    DRAIN = "drain"
    DIE = "die"


TRANSITIONS: Final[dict[tuple[Phase, Change], Phase]] = {
    (Phase.STARTING, Change.SERVE): Phase.READY,
    (Phase.STARTING, Change.SLEEP): Phase.SLEEPING,  # a paused stage's new replica starts asleep
    (Phase.SLEEPING, Change.SERVE): Phase.SLEEPING,  # ... and is serving, asleep
    (Phase.READY, Change.SLEEP): Phase.SLEEPING,
    (Phase.SLEEPING, Change.SLEEP): Phase.SLEEPING,  # deeper
    (Phase.SLEEPING, Change.WAKE): Phase.READY,
    (Phase.STARTING, Change.DRAIN): Phase.DRAINING,
    (Phase.READY, Change.DRAIN): Phase.DRAINING,
    (Phase.SLEEPING, Change.DRAIN): Phase.DRAINING,
    (Phase.DRAINING, Change.DRAIN): Phase.DRAINING,  # a second signal: it stops at once
    (Phase.DRAINING, Change.SERVE): Phase.DRAINING,  # told to stop while it loaded: it stops
    (Phase.DEAD, Change.DRAIN): Phase.DEAD,  # told to stop while failing: it is stopping already
    (Phase.DEAD, Change.SERVE): Phase.DEAD,  # its engine failed as it started (a first sleep)
    **{(phase, Change.DIE): Phase.DEAD for phase in Phase},
}
"""Every move a replica makes; any other is a bug (`InvalidChange`)."""


class InvalidChange(RuntimeError):
    """A change the replica's phase does not allow (a wake while draining, anything once dead)."""


@dataclass
class ReplicaState:
    """One replica's phase, its sleep level while asleep, why it died, and its health."""

    phase: Phase = Phase.STARTING
    level: int | None = None
    """The sleep level while SLEEPING (vLLM's: 0 frees nothing, 1 offloads, 2 drops weights)."""
    dead: str | None = None
    """Why the engine can serve nothing more, once DEAD."""
    unhealthy: str = ""
    """Why it takes nothing new for now (a connector's backend is down); empty: healthy."""

    def change(self, change: Change, *, level: int | None = None, why: str | None = None) -> Phase:
        """Moves by `TRANSITIONS` (InvalidChange otherwise); a sleep names its `level`, a death
        its `why`."""
        to = TRANSITIONS.get((self.phase, change))
        if to is None:
            raise InvalidChange(f"a replica {self.phase} cannot {change}")
        if change is Change.SLEEP and level is None:
            raise InvalidChange("a sleep names its level")
        self.phase = to
        if to is not Phase.SLEEPING:
            self.level = None
        elif change is Change.SLEEP:
            self.level = level
        if change is Change.DIE:
            self.dead = why or "unknown"
        return to

    @property
    def asleep(self) -> int | None:
        """The sleep level while asleep; None otherwise."""
        return self.level if self.phase is Phase.SLEEPING else None

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    def readiness(self, connected: bool) -> tuple[bool, str, str]:
        """Ready or not, the status word and why. A sleeping replica is ready (Kubernetes must
        not hold a rollout or restart for it; it is up and doing as told): `sleeping`."""
        if self.phase is Phase.DEAD:
            return False, "not ready", f"engine dead: {self.dead}"
        if self.phase is Phase.STARTING:
            return False, "not ready", "starting"
        if self.unhealthy:
            return False, "not ready", self.unhealthy
        if self.phase is Phase.DRAINING:
            return False, "not ready", "draining"
        if not connected:
            return False, "not ready", "NATS disconnected"
        if self.phase is Phase.SLEEPING:
            return True, "sleeping", f"asleep at level {self.level}"
        return True, "ready", "ok"
