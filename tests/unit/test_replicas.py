"""The gateway's replica table: load between heartbeats, so a busy-but-keeping-up replica is
never refused as full, and a full one is; a heartbeat that lags behind our releases does not
make a replica look fuller than it is."""

from __future__ import annotations

import pytest

from omni_gateway.errors import Overloaded
from omni_gateway.replicas import ReplicaTable
from omni_pipeline.control import Heartbeat

OURS = "omni.p.gateway.g1.in"


def beat(queued: int = 0, inflight: int = 0, instance: str = "i1", ours: int = 0) -> Heartbeat:
    return Heartbeat(
        stage="s",
        replica="0",
        instance=instance,
        pid=1,
        host="h",
        queued=queued,
        inflight=inflight,
        capacity=1,
        max_queued=4,
        draining=False,
        interval_s=1.0,
        by_gateway={OURS: ours} if ours else {},
    )


def test_requests_that_finish_between_beats_free_their_room() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    for _ in range(100):  # far more than capacity + max_queued, one at a time, within one beat
        r = table.pick("s")
        table.release("s", "0", "i1")
    assert r.load == 0


def test_a_replica_is_full_at_capacity_plus_queue() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    for _ in range(5):
        table.pick("s")
    with pytest.raises(Overloaded):
        table.pick("s")
    # The next beat counts those five; the load stays five, not ten.
    table.update(beat(queued=4, inflight=1, ours=5), 0.5)
    assert table.get("s", "0").load == 5  # type: ignore[union-attr]
    table.release("s", "0", "i1")
    assert table.get("s", "0").load == 4  # type: ignore[union-attr]


def test_other_gateways_load_counts_too() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(queued=3, inflight=1), 0.0)
    table.pick("s")
    with pytest.raises(Overloaded):
        table.pick("s")


def test_a_restarted_replica_starts_from_its_own_beat() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    table.pick("s")
    assert table.update(beat(instance="i2"), 0.5) is not None
    table.release("s", "0", "i1")  # a request of the old instance ending: not the new one's
    assert table.get("s", "0").load == 0  # type: ignore[union-attr]


def test_beats_missed_while_the_gateway_could_not_hear_do_not_count() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    table.heard_all(10.0)  # NATS came back at t=10 after a long outage
    assert table.expire(12.0) == []
    assert [r.hb.replica for r in table.expire(13.5)] == ["0"]  # three beats missed since


def test_a_beat_sent_before_our_requests_ended_does_not_hold_their_room() -> None:
    """Five of ours were running when the replica sent its beat; three ended before it arrived.
    The replica holds two of ours: three more fit (it was once thought full for a beat)."""
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    for _ in range(5):
        table.pick("s")
    for _ in range(3):
        table.release("s", "0", "i1")
    table.update(beat(queued=4, inflight=1, ours=5), 0.9)
    assert table.get("s", "0").load == 2  # type: ignore[union-attr]
    for _ in range(3):
        table.pick("s")
    with pytest.raises(Overloaded):
        table.pick("s")
