"""The replica's scheduling core: run, queue, refuse, release in order, abort."""

from __future__ import annotations

from omni_stage.core import ABORTED_MEMORY, Admission, StageCore
from omni_stage.state import Change, ReplicaState


def test_admission_order_and_limits() -> None:
    core = StageCore(max_inflight=2, max_queued=1)
    assert [core.admit(r) for r in "abcd"] == [
        Admission.RUN,
        Admission.RUN,
        Admission.QUEUE,
        Admission.REJECT_FULL,
    ]
    assert core.is_aborted("d")
    assert core.load().queued == 1 and core.load().inflight == 2
    assert core.release("a") == ["c"]
    assert core.release("b") == [] and core.has_work()
    assert core.release("c") == [] and not core.has_work()


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    """vLLM's priority: the lower value first (a batch's lines wait behind live users' requests,
    whenever they came); equal priorities in arrival order; one aborted while waiting is skipped."""
    core = StageCore(max_inflight=1, max_queued=8)
    assert core.admit("live-0") is Admission.RUN
    for rid, priority in (("batch-1", 1), ("batch-2", 1), ("live-1", 0), ("urgent", -1), ("live-2", 0)):
        assert core.admit(rid, priority) is Admission.QUEUE
    core.abort("live-1")
    started = [core.release("live-0")[0]]
    while core.waiting:
        started += core.release(started[-1])
    assert started == ["urgent", "live-2", "batch-1", "batch-2"]


def test_abort_queued_and_running() -> None:
    core = StageCore(max_inflight=1, max_queued=4)
    core.admit("a")
    core.admit("b")
    assert core.abort("b") is False and not core.known("b") and core.is_aborted("b")
    assert core.abort("a") is True
    assert core.release("a") == []


def test_draining_refuses_new_work() -> None:
    state = ReplicaState()
    core = StageCore(1, 1, state)
    state.change(Change.SERVE)
    state.change(Change.DRAIN)
    assert core.admit("a") is Admission.REJECT_DRAINING


def test_a_sleeping_core_refuses_new_work_and_keeps_what_it_holds() -> None:
    state = ReplicaState()
    core = StageCore(1, 1, state)
    state.change(Change.SERVE)
    assert core.admit("a") is Admission.RUN
    state.change(Change.SLEEP, level=1)
    assert core.admit("b") is Admission.REJECT_SLEEPING and core.is_aborted("b")
    assert core.known("a") and core.has_work()  # the replica decides to finish or abort it
    assert core.release("a") == [] and not core.has_work()
    state.change(Change.WAKE)
    assert core.admit("c") is Admission.RUN


def test_aborted_memory_is_bounded() -> None:
    core = StageCore(1, 0)
    for i in range(ABORTED_MEMORY + 10):
        core.abort(f"r{i}")
    assert not core.is_aborted("r0") and core.is_aborted(f"r{ABORTED_MEMORY + 9}")
