"""Flow control's bookkeeping: a producer's credit ledger, and the core's paused requests."""

from __future__ import annotations

from omni_stage.core import Admission, StageCore
from omni_stage.credit import CreditLedger


def test_credit_is_spent_by_sends_and_returned_by_reads() -> None:
    ledger = CreditLedger({"talker": 2, "vocoder": 1})
    ledger.open("r", deadline=100.0, consumers=["talker"])
    ledger.sent("r", "talker", 10)
    ledger.sent("r", "talker", 20)
    assert ledger.available("r", "talker") == 0 and ledger.unread_bytes == 30
    assert ledger.returned("r", "talker", 1)
    assert ledger.available("r", "talker") == 1 and ledger.unread_bytes == 20  # the oldest was read
    assert not ledger.returned("r", "vocoder", 1)  # not on this request's route
    assert not ledger.returned("other", "talker", 1)
    assert ledger.returned("r", "talker", 5)  # more than was sent returns only what was sent
    assert ledger.available("r", "talker") == 2 and ledger.unread_bytes == 0
    assert not ledger.returned("r", "talker", 1) and not ledger.returned("r", "talker", -3)
    assert ledger.available("r", "talker") == 2


def test_an_ended_request_is_kept_until_its_consumers_have_read_it() -> None:
    ledger = CreditLedger({"talker": 4})
    ledger.open("r", deadline=100.0, consumers=["talker"])
    ledger.sent("r", "talker", 8)
    ledger.close("r")
    assert ledger.tracked() == 1 and ledger.unread_bytes == 8
    ledger.returned("r", "talker", 1)
    assert ledger.tracked() == 0 and ledger.unread_bytes == 0


def test_failed_and_expired_requests_are_forgotten() -> None:
    ledger = CreditLedger({"talker": 4})
    for rid, deadline in (("a", 10.0), ("b", 10.0), ("c", 50.0)):
        ledger.open(rid, deadline, ["talker"])
        ledger.sent(rid, "talker", 100)
    ledger.forget("a")
    assert ledger.unread_bytes == 200
    assert ledger.expire(20.0, keep={"c"}) == ["b"]
    assert ledger.expire(60.0, keep={"c"}) == []  # still running: its own end forgets it
    assert ledger.tracked() == 1 and ledger.unread_bytes == 100


def test_a_paused_request_hands_its_slot_to_a_queued_one() -> None:
    core = StageCore(max_inflight=1, max_queued=2)
    assert core.admit("a") is Admission.RUN
    assert core.admit("b") is Admission.QUEUE
    assert core.pause("a") == ["b"]
    assert core.load().inflight == 2 and core.load().paused == 1
    core.resume("a")  # past max_inflight for a while: it was admitted to run
    assert core.running == {"a", "b"} and not core.paused
    assert core.admit("c") is Admission.QUEUE
    assert core.admit("d") is Admission.REJECT_FULL  # running, paused and queued: 3 held at most
    assert core.release("a") == []  # b still runs: nothing starts
    assert core.release("b") == ["c"]


def test_an_aborted_paused_request_is_reported_running() -> None:
    core = StageCore(max_inflight=1, max_queued=0)
    core.admit("a")
    core.pause("a")
    assert core.known("a") and core.abort("a")  # the caller cancels its task
    assert core.release("a") == [] and not core.has_work()
