"""Request tasks: admit a request, start its task, abort it, and free what it held when it ends.

Each running request is one asyncio task over the runner. Its end is a done callback, not a
`finally`, since an abort may cancel a task before it ever ran. Whatever way a request ends,
its end frees it in every connector (unless it completed: its consumers free what they read),
hands its slot to the queued requests, and tells the replica when it holds nothing any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from omni_pipeline import tracing
from omni_pipeline.control import Admitted, ErrorCode, RequestContext
from omni_pipeline.tracing import TRACER
from omni_stage.metrics import StageMetrics
from omni_stage.outbox import Outbox
from omni_stage.requests import RequestBook, RequestState
from omni_stage.transfer import Transfers

log = logging.getLogger("omni.stage")


class RequestTasks:
    """Starts and ends the tasks of one replica's requests."""

    def __init__(
        self,
        *,
        book: RequestBook,
        transfers: Transfers,
        outbox: Outbox,
        metrics: StageMetrics,
        run: Callable[[RequestState], Coroutine[Any, Any, str]],
        on_idle: Callable[[], None],
    ) -> None:
        self.book = book
        self.transfers = transfers
        self.outbox = outbox
        self.metrics = metrics
        self.replica = outbox.replica
        self.on_idle = on_idle
        """Called when a request ended and the replica holds nothing (a sleep, a drain wait)."""
        self.run = run
        """What runs a request to its end (the runner's)."""
        self._notices: set[asyncio.Task[None]] = set()  # error notices waiting for NATS to return
        self._ended_by_outage: set[str] = set()  # freed again when NATS is back

    def admit(self, ctx: RequestContext, carried: dict[str, str] | None) -> RequestState | Admitted:
        """Admit a new request, and start it if it runs now; or the refusal."""
        admitted = self.book.admit(ctx)
        if isinstance(admitted, Admitted):
            self.metrics.admission(admitted.code)
            return admitted
        runs = self.book.runs_now(admitted)
        self.metrics.admission("run" if runs else "queued")
        stage = self.book.spec.name
        attributes = {"omni.request_id": ctx.request_id, "omni.stage": stage, "omni.replica": self.replica}
        # Its parent: the gateway's span that sent the request (carried in the headers).
        admitted.span = TRACER.start_span(
            "omni.stage.request", tracing.extract(carried), SpanKind.SERVER, attributes
        )
        if runs:
            self.start(admitted)
        return admitted

    def start(self, st: RequestState) -> None:
        st.task = asyncio.get_running_loop().create_task(self.run(st), name=f"req-{st.request_id}")
        st.task.add_done_callback(lambda task: self._finished(st, task))

    def abort(self, rid: str) -> None:
        """End a request now: cancel its task (its end frees it), or drop it from the queue."""
        st, running = self.book.abort(rid)
        if running:
            assert st is not None and st.task is not None
            st.task.cancel()
            return
        if st is not None:  # queued, never started
            self.metrics.outcome("aborted")
            st.span.set_attribute("omni.outcome", "aborted")
            st.span.end()
        self.transfers.free_written(rid)
        self._check_idle()

    def cancel_all(self) -> None:
        """Shutting down: cancel every running request's task."""
        for st in list(self.book.requests.values()):
            if st.task:
                st.task.cancel()

    def end_all_for_outage(self) -> None:
        """NATS is lost. What we sent just before the drop may be lost, so no request we hold can
        be trusted to finish: end each now (its error goes out once NATS is back), not at its
        deadline."""
        held = [st.ctx for st in self.book.requests.values()]
        why = f"{self.book.where} lost its connection to NATS while serving this request"
        for ctx in held:
            self._ended_by_outage.add(ctx.request_id)
            self.abort(ctx.request_id)
        if held:
            notice = self.outbox.fail_all(held, why, ErrorCode.NATS_LOST)
            task = asyncio.get_running_loop().create_task(notice)
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    def free_again_after_outage(self) -> None:
        """NATS is back. Free the requests the outage ended once more: another stage may have
        been writing a payload for one when we freed it first (a write in progress is not
        freed), and its message saying so was lost with the server."""
        for rid in self._ended_by_outage:
            self.transfers.cleanup(rid)
        self._ended_by_outage.clear()

    def _finished(self, st: RequestState, task: asyncio.Task[str]) -> None:
        """A request's task ended, whether or not it ever ran: free what the request held."""
        rid = st.request_id
        outcome = "aborted" if task.cancelled() else ("error" if task.exception() else task.result())
        st.span.set_attribute("omni.outcome", outcome)
        if outcome not in ("ok", "aborted"):
            st.span.set_status(StatusCode.ERROR, outcome)
        st.span.end()
        with tracing.within(st.span):  # the line names its trace
            log.info("stage %s/%s: request %s %s", self.book.spec.name, self.replica, rid, outcome)
        if outcome != "ok":
            self.transfers.free_written(rid)
        self.metrics.outcome(outcome)
        for queued in self.book.ended(rid, ok=outcome == "ok"):
            self.start(queued)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.book.has_work():
            self.on_idle()
