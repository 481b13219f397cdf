"""The stage worker's request state machine, driven directly: no NATS, no processes, no tasks.

A replica's admission (and each refusal's code), its inputs turned into triggers, what a segment
sends on each out-edge (windows, sequence numbers, credit), and how a request ends.
"""

from __future__ import annotations

import time

import pytest
import torch

from omni_pipeline.connectors import ConnectorHandle, build_connectors
from omni_pipeline.control import (
    Admitted,
    ErrorCode,
    RequestContext,
    RequestInputs,
    SegmentMsg,
    StageRequest,
)
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import REQUEST_SOURCE, load_pipeline
from omni_stage.assembly import AssemblyError
from omni_stage.requests import OutEdge, RequestBook, RequestState
from omni_stage.segments import Segment
from omni_stage.state import Change, Phase, ReplicaState
from tests.helpers import ROOT

PIPELINE = load_pipeline(ROOT / "tests" / "data" / "synthetic.yaml")
ROUTE = {"thinker": "0", "talker": "0", "vocoder": "0"}


def book(stage: str, **changes: object) -> RequestBook:
    spec = PIPELINE.spec.stage(stage).model_copy(update=changes)
    connectors = build_connectors(PIPELINE.spec, PIPELINE.name)
    edges = [
        OutEdge(s.name, e.window, connectors[e.connector], e.credit, e.first_window)
        for s, e in PIPELINE.spec.consumers(stage)
    ]
    return RequestBook(spec, edges, f"stage '{stage}' replica 0", ReplicaState(Phase.READY))


def ctx(rid: str, route: dict[str, str] = ROUTE) -> RequestContext:
    return RequestContext(rid, route, "_INBOX.gw", time.time() + 60)


def admitted(b: RequestBook, rid: str, route: dict[str, str] = ROUTE) -> RequestState:
    st = b.admit(ctx(rid, route))
    assert isinstance(st, RequestState), st
    return st


def refusal(b: RequestBook, rid: str, route: dict[str, str] = ROUTE) -> Admitted:
    answer = b.admit(ctx(rid, route))
    assert isinstance(answer, Admitted) and not answer.ok, answer
    return answer


def segment(units: int, is_last: bool = False, seq: int = 0) -> Segment:
    return Segment(seq, units, "", ({"hidden": torch.zeros(units, 4)},), is_last)


def test_admission_runs_then_queues_then_refuses_full() -> None:
    b = book("talker", max_inflight=1, max_queued=1)
    first, second = admitted(b, "a"), admitted(b, "b")
    assert b.runs_now(first) and not b.runs_now(second)
    answer = refusal(b, "c")
    assert answer.code == ErrorCode.FULL and "stage 'talker' replica 0 is full" in answer.message
    assert b.is_aborted("c")  # its late inputs are dropped and freed
    assert [st.request_id for st in b.ended("a", ok=True)] == ["b"]  # the queued one starts


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        (lambda b: setattr(b.state, "unhealthy", "connector 'default' (shm): down"), ErrorCode.UNHEALTHY),
        (lambda b: b.state.change(Change.DRAIN), ErrorCode.DRAINING),
        (lambda b: b.state.change(Change.SLEEP, level=1), ErrorCode.SLEEPING),
        (lambda b: admitted(b, "r"), ErrorCode.DUPLICATE_REQUEST),
    ],
    ids=["unhealthy", "draining", "asleep", "duplicate"],
)
def test_each_refusal_has_its_code(setup, code: ErrorCode) -> None:  # type: ignore[no-untyped-def]
    b = book("talker")
    setup(b)
    assert refusal(b, "r").code == code


def test_a_stage_off_the_route_or_with_no_input_on_it_refuses() -> None:
    b = book("vocoder")
    assert refusal(b, "a", {"thinker": "0", "talker": "0"}).code == ErrorCode.BAD_ROUTE
    assert refusal(b, "b", {"thinker": "0", "vocoder": "0"}).code == ErrorCode.BAD_ROUTE  # talker feeds it


def test_unread_output_over_max_unread_bytes_refuses_new_requests() -> None:
    b = book("thinker", max_unread_bytes=100)
    st = admitted(b, "a")
    b.start(st)
    (send,) = b.plan(st, segment(8))  # the talker's window is 8: one chunk
    b.sent(st, send, 100)
    assert refusal(b, "b").code == ErrorCode.FULL
    b.credit_back("a", "talker", 1)  # read: its bytes no longer count
    admitted(b, "b")


def test_a_source_takes_all_sampling_others_only_what_their_engine_reads() -> None:
    thinker, talker = book("thinker"), book("talker")
    asked = Sampling(max_tokens=5, speed=1.5)
    st = admitted(thinker, "a")
    assert thinker.take_request(st, StageRequest(ctx("a"), None, asked), frozenset())
    assert st.sampling == asked
    st = admitted(talker, "a")
    assert not talker.take_request(st, StageRequest(ctx("a"), None, asked), frozenset({"speed"}))
    assert st.sampling == Sampling(speed=1.5)


def test_inputs_become_triggers_in_sequence_order() -> None:
    b = book("talker")
    st = admitted(b, "a")

    def chunk(seq: int, units: int, last: bool) -> SegmentMsg:
        return SegmentMsg(ctx("a"), "thinker", seq, last, units, ConnectorHandle("default", 0, b""))

    b.add_input(st, "thinker", 1, chunk(1, 3, True), 3, True)
    assert st.triggers.empty()  # waits for chunk 0
    b.add_input(st, "thinker", 0, chunk(0, 8, False), 8, False)
    first, last = st.triggers.get_nowait(), st.triggers.get_nowait()
    assert (first.units, first.is_last, last.units, last.is_last) == (8, False, 3, True)
    assert st.triggers.empty()
    with pytest.raises(AssemblyError):
        b.add_input(st, "thinker", 1, chunk(1, 3, True), 3, True)


def test_a_request_as_input_is_one_last_trigger() -> None:
    b = book("thinker")
    st = admitted(b, "a")
    m = StageRequest(ctx("a"), RequestInputs(messages=[]), Sampling())
    b.add_input(st, REQUEST_SOURCE, 0, m, 0, True)
    trig = st.triggers.get_nowait()
    assert trig.is_last and trig.inputs == {REQUEST_SOURCE: m}


def test_windows_plan_numbered_chunks_and_charge_credit() -> None:
    b = book("thinker")  # -> talker, window 8, credit from the spec
    st = admitted(b, "a")
    b.start(st)
    credit = b.credit(st, "talker")
    assert b.plan(st, segment(4)) == []  # half a window: nothing yet
    (send,) = b.plan(st, segment(4, seq=1))
    assert (send.edge.consumer, send.sequence, send.chunk.units, send.charged) == ("talker", 0, 8, True)
    b.sent(st, send, 64)
    assert b.credit(st, "talker") == credit - 1 and b.ledger.unread_bytes == 64
    (last,) = b.plan(st, segment(3, is_last=True, seq=2))
    assert (last.sequence, last.chunk.units, last.chunk.is_last) == (1, 3, True)


def test_a_route_without_the_consumer_sends_nothing_to_it() -> None:
    b = book("thinker")
    st = admitted(b, "a", {"thinker": "0"})  # text only
    b.start(st)
    assert b.plan(st, segment(8, is_last=True)) == []


def test_waiting_for_credit_pauses_and_hands_the_slot_on() -> None:
    b = book("thinker", max_inflight=1, max_queued=1)
    a, queued = admitted(b, "a"), admitted(b, "b")
    b.start(a)
    assert b.pause(a) == [queued]  # b runs while a waits for its consumer
    b.resume(a)
    assert b.core.load().inflight == 2  # a goes on past max_inflight: it was admitted to run
    b.credit_back("a", "talker", 1)  # nothing was sent: no credit is made up
    assert not a.credit_returned.is_set()


def test_abort_drops_a_queued_request_and_reports_a_running_one() -> None:
    b = book("talker", max_inflight=1, max_queued=1)
    running, queued = admitted(b, "a"), admitted(b, "b")
    assert b.abort("b") == (queued, False) and "b" not in b.requests
    running.task = object()  # type: ignore[assignment]  # what the process would have started
    assert b.abort("a") == (running, True) and "a" in b.requests  # its task's end frees it
    assert b.ended("a", ok=False) == [] and not b.has_work()
    assert b.is_aborted("a") and b.is_aborted("b")


def test_a_failed_request_forgets_its_unread_output() -> None:
    b = book("thinker")
    st = admitted(b, "a")
    b.start(st)
    (send,) = b.plan(st, segment(8))
    b.sent(st, send, 100)
    b.ended("a", ok=False)
    assert b.ledger.unread_bytes == 0 and b.ledger.tracked() == 0
