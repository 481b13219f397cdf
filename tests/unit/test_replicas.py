"""The gateway's replica table: load between heartbeats, so a busy-but-keeping-up replica is
never refused as full, and a full one is; a heartbeat that lags behind our releases does not
make a replica look fuller than it is."""

from __future__ import annotations

import msgspec
import pytest

from omni_gateway.errors import Overloaded, Unavailable
from omni_gateway.replicas import ReplicaTable
from omni_pipeline.control import Admitted, Heartbeat

OURS = "omni.p.gateway.g1.in"


def beat(
    queued: int = 0,
    inflight: int = 0,
    instance: str = "i1",
    ours: int = 0,
    draining: bool = False,
    stopping: bool = False,
    asleep: int | None = None,
) -> Heartbeat:
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
        draining=draining,
        stopping=stopping,
        interval_s=1.0,
        by_gateway={OURS: ours} if ours else {},
        asleep=asleep,
        max_sleep_level=2,
    )


def test_requests_that_finish_between_beats_free_their_room() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    for _ in range(100):  # far more than capacity + max_queued, one at a time, within one beat
        r = table.pick("s")
        table.release("s", "i1")
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
    assert table.get("s", "i1").load == 5  # type: ignore[union-attr]
    table.release("s", "i1")
    assert table.get("s", "i1").load == 4  # type: ignore[union-attr]


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
    assert [r.hb.instance for r in table.update(beat(instance="i2"), 0.5)] == ["i1"]
    table.release("s", "i1")  # a request of the old instance ending: not the new one's
    assert table.get("s", "i2").load == 0  # type: ignore[union-attr]


def test_a_draining_instance_and_its_successor_live_side_by_side() -> None:
    """A rolling restart under one replica name: the old instance finishes its requests while
    the new one takes new ones; neither beat order takes either out of the table early."""
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    table.update(beat(draining=True), 0.2)
    assert table.update(beat(instance="i2"), 0.5) == []  # draining is no sign of death
    assert table.pick("s").hb.instance == "i2"
    table.update(beat(draining=True), 0.9)  # the old one's beats go on until it is done
    assert table.update(beat(stopping=True), 1.0) == []
    assert [r["instance"] for r in table.snapshot()] == ["i2"]


def test_a_late_beat_of_a_stopped_instance_never_brings_it_back() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(draining=True), 0.0)
    table.update(beat(stopping=True), 0.5)
    table.update(beat(instance="i2"), 0.6)
    assert table.update(beat(draining=True), 0.7) == []  # sent before its stop, read after
    assert [r["instance"] for r in table.snapshot()] == ["i2"]
    assert table.update(beat(stopping=True), 0.8) == []  # the old one's stop again: i2 stays
    assert table.pick("s").hb.instance == "i2"


def test_removing_an_instance_leaves_its_successor() -> None:
    table = ReplicaTable(OURS)
    table.update(beat(draining=True), 0.0)
    table.update(beat(instance="i2"), 0.1)
    assert table.remove("s", "i1") is not None  # nothing answered on the old one's behalf
    assert table.pick("s").hb.instance == "i2"


def test_a_replica_that_only_went_quiet_comes_back_with_its_next_beat() -> None:
    """Not answering (reconnecting to NATS) or missing beats is no proof of death."""
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    assert table.remove("s", "i1") is not None
    table.update(beat(), 0.5)
    assert [r.hb.instance for r in table.expire(4.0)] == ["i1"]
    table.update(beat(), 4.5)
    assert table.pick("s").hb.instance == "i1"


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
        table.release("s", "i1")
    table.update(beat(queued=4, inflight=1, ours=5), 0.9)
    assert table.get("s", "i1").load == 2  # type: ignore[union-attr]
    for _ in range(3):
        table.pick("s")
    with pytest.raises(Overloaded):
        table.pick("s")


def test_a_replica_that_refuses_for_its_health_is_believed_until_its_next_beat() -> None:
    """Its health check can find its connector down a beat before the gateway hears it: the
    refusal says so, and a retry is a 503 naming why, not the same replica asked again (seen
    in tests/faults/test_mooncake_restart.py as a 500)."""
    table = ReplicaTable(OURS)
    table.update(beat(), 0.0)
    table.refused(
        "s", "i1", Admitted(False, "unhealthy", "stage 's' replica 0 is unhealthy: x", unhealthy="x")
    )
    with pytest.raises(Unavailable, match=r"no live replica \(unhealthy: x\)"):
        table.pick("s")
    table.update(beat(), 0.5)  # its next beat: healthy again
    assert table.pick("s").hb.instance == "i1"
    table.refused("s", "i1", Admitted(False, "draining", "stage 's' replica 0 is draining"))
    with pytest.raises(Unavailable):
        table.pick("s")


def test_a_stage_is_sick_when_every_replica_up_says_it_is_unhealthy() -> None:
    """Then a request is a 503 at once (it would wait for a replica only while one restarts)."""
    t = ReplicaTable(OURS)
    assert not t.sick("s")  # none known: one may be starting
    t.update(beat(), 0.0)
    assert not t.sick("s")
    t.refused("s", "i1", Admitted(False, "unhealthy", "down", unhealthy="connector 'remote': down"))
    assert t.sick("s")
    t.update(beat(), 1.0)  # its next beat: healthy again
    assert not t.sick("s")


def test_a_sleeping_stage_is_a_503_at_once_and_still_covered() -> None:
    """Asleep is not gone: the gateway stays ready (other outputs still serve) and a request
    needing the stage is answered 503 with Retry-After, naming how to wake it; awake again, it
    serves."""
    t = ReplicaTable(OURS)
    t.update(beat(asleep=2), 0.0)
    assert t.asleep("s") and t.covers(["s"])
    with pytest.raises(Unavailable, match="stage 's' is asleep; POST /v1/omni/wakeup") as info:
        t.pick("s")
    assert info.value.code == "stage_asleep" and int(info.value.headers["Retry-After"]) > 0
    assert [r.hb.instance for r in t.up(["s"])] == ["i1"]  # what a wake is sent to
    t.update(beat(), 0.5)
    assert not t.asleep("s") and t.pick("s").hb.instance == "i1"


def test_a_replica_that_refuses_for_sleep_is_believed_until_its_next_beat() -> None:
    t = ReplicaTable(OURS)
    t.update(beat(), 0.0)
    t.refused("s", "i1", Admitted(False, "sleeping", "stage 's' replica 0 is asleep (level 1)"))
    with pytest.raises(Unavailable, match="asleep"):
        t.pick("s")
    t.update(beat(), 0.5)
    assert t.pick("s").hb.instance == "i1"


def test_a_conversations_replica_is_picked_while_it_serves_with_room() -> None:
    """`prefer` (the instance keeping a conversation's sequence) wins over a less loaded one;
    full or draining, the least loaded serves instead."""
    table = ReplicaTable(OURS)
    table.update(beat(inflight=2, instance="kept"), 0.0)
    table.update(msgspec.structs.replace(beat(instance="idle"), replica="1"), 0.0)
    assert table.pick("s").hb.instance == "idle"
    assert table.pick("s", prefer="kept").hb.instance == "kept"
    for _ in range(2):  # to capacity + max_queued
        table.pick("s", prefer="kept")
    assert table.pick("s", prefer="kept").hb.instance == "idle"
    table.update(beat(instance="kept", draining=True), 1.0)
    table.release("s", "kept")
    assert table.pick("s", prefer="kept").hb.instance == "idle"
