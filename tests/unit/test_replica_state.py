"""A replica's state (omni_stage.state), driven as a table: every phase against every change,
what it moves to or that it is refused, and what admission, readiness and the heartbeat then
read of it."""

from __future__ import annotations

import pytest

from omni_stage.core import Admission, StageCore
from omni_stage.state import TRANSITIONS, Change, InvalidChange, Phase, ReplicaState

S, R, Z, D, X = Phase.STARTING, Phase.READY, Phase.SLEEPING, Phase.DRAINING, Phase.DEAD
EXPECTED: dict[Phase, dict[Change, Phase | None]] = {
    #        serve  sleep  wake  drain  die
    S: dict(zip(Change, (R, Z, None, D, X), strict=True)),
    R: dict(zip(Change, (None, Z, None, D, X), strict=True)),
    Z: dict(zip(Change, (Z, Z, R, D, X), strict=True)),
    D: dict(zip(Change, (D, None, None, D, X), strict=True)),
    X: dict(zip(Change, (X, None, None, X, X), strict=True)),
}
"""From each phase (rows), by each change (columns), the phase it moves to; None: refused."""


def state_in(phase: Phase) -> ReplicaState:
    """A replica brought to `phase` by the moves it makes to get there."""
    s = ReplicaState()
    path = {
        S: [],
        R: [(Change.SERVE, None)],
        Z: [(Change.SERVE, None), (Change.SLEEP, 2)],
        D: [(Change.SERVE, None), (Change.DRAIN, None)],
        X: [(Change.DIE, None)],
    }[phase]
    for change, level in path:
        s.change(change, level=level, why="engine gone")
    assert s.phase is phase
    return s


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("change", list(Change))
def test_every_phase_by_every_change(phase: Phase, change: Change) -> None:
    s = state_in(phase)
    expected = EXPECTED[phase][change]
    assert TRANSITIONS.get((phase, change)) is expected
    if expected is None:
        with pytest.raises(InvalidChange):
            s.change(change, level=1)
        assert s.phase is phase  # a refused change changes nothing
        return
    assert s.change(change, level=1, why="wedged") is expected
    assert s.asleep == (1 if change is Change.SLEEP else 2 if expected is Z else None)
    assert (s.dead is not None) == (expected is X)


def test_a_sleep_names_its_level() -> None:
    with pytest.raises(InvalidChange, match="level"):
        state_in(R).change(Change.SLEEP)


@pytest.mark.parametrize(
    ("phase", "admission", "ready", "word"),
    [
        (S, Admission.RUN, False, "not ready"),
        (R, Admission.RUN, True, "ready"),
        (Z, Admission.REJECT_SLEEPING, True, "sleeping"),
        (D, Admission.REJECT_DRAINING, False, "not ready"),
        (X, Admission.REJECT_DRAINING, False, "not ready"),
    ],
)
def test_what_admission_and_readiness_read_of_each_phase(
    phase: Phase, admission: Admission, ready: bool, word: str
) -> None:
    s = state_in(phase)
    assert StageCore(1, 1, s).admit("r") is admission
    assert s.readiness(connected=True)[:2] == (ready, word)
    assert s.draining == (phase is D)


def test_health_is_beside_the_phase_and_a_replica_asleep_stays_asleep() -> None:
    s = state_in(Z)
    s.unhealthy = "connector 'default' (mooncake): master unreachable"
    assert s.asleep == 2  # a wake still reaches it (the gateway reads it asleep)
    assert s.readiness(connected=True) == (False, "not ready", s.unhealthy)
    s.unhealthy = ""
    assert s.readiness(connected=True) == (True, "sleeping", "asleep at level 2")
    assert state_in(R).readiness(connected=False) == (False, "not ready", "NATS disconnected")
