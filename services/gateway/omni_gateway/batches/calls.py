"""How a batch line is sent and when it may start: each line a request to the gateway's own
endpoint in the same process (omni_gateway.internal), at the batch priority (replicas start
live users' requests first), once it holds one of `concurrency` slots, the lines running and
the room kept for each live request this gateway serves (`livePriority`) stay under
`concurrency`, and the pipeline's entry has a free slot (lines wait here, not in a replica's
queue)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from typing import Any, Final

import httpx
import msgspec

from omni_gateway.batches.lines import InputLine, answered, not_run
from omni_gateway.batches.records import Batch
from omni_gateway.errors import BadRequest
from omni_gateway.internal import JOB_ID_HEADER, ON_BEHALF_HEADER, internal_client
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.request import BATCH_PRIORITY, ON_ROUTED
from omni_pipeline.settings import BatchesSpec

log = logging.getLogger("omni.gateway.batches")

INTERNAL_HEADER: Final = "x-omni-batch"
"""Names the batch a request runs for (in the gateway's logs)."""
LIVE_POLL_S: Final = 0.02
"""How often a line waiting for live users to leave room looks again."""
VIDEOS: Final = "/v1/videos"
VIDEO_POLL_S: Final = 0.5
"""How often a video line looks at its job (made by the gateway's video job runner)."""
BATCH_LINE_PRIORITY: Final = 1
"""Added to a line's own `priority`: replicas start live users' requests (0) first."""


class Unrouted:
    """A line let through to the pipeline, counted against the entry's free slots until its
    request has replicas (the attempt calls it) or its task ends, started or not (the runner
    calls it): calling it stops the count, once."""

    def __init__(self, calls: LineCalls | None) -> None:
        self._calls = calls
        if calls is not None:
            calls.unrouted += 1

    def __call__(self) -> None:
        if self._calls is not None:
            self._calls.unrouted -= 1
            self._calls = None


class LineCalls:
    def __init__(self, app: Any, pipeline: Pipeline, spec: BatchesSpec, metrics: GatewayMetrics) -> None:
        self.spec, self.metrics, self._pipeline = spec, metrics, pipeline
        self._client = internal_client(app)
        self._slots = asyncio.Semaphore(spec.concurrency)
        """Lines of this gateway's batches let through, started or about to be (`room`)."""
        self._in_pipeline = 0
        """Lines in a request to the pipeline now (counted in the gateway's in-flight requests;
        a video line waiting on its job is not)."""
        self.unrouted = 0
        """Lines let through to the pipeline whose requests have no replicas yet."""

    async def close(self) -> None:
        await self._client.aclose()

    def _live(self) -> int:
        """Live users' requests this gateway serves now: every request in flight but its own lines."""
        serving = self.metrics.registry.get_sample_value("omni_gateway_inflight_requests") or 0.0
        return max(0, int(serving) - self._in_pipeline)

    async def room(self, batch: Batch) -> Unrouted:
        """Wait for one of `concurrency` slots, then until this gateway's batch lines, and
        `livePriority` lines' room for each live request it serves, leave room for one more
        line within `concurrency`, and (a line through the pipeline) a replica of the
        pipeline's entry has a slot free for it that no line let through before has yet taken:
        live users' new requests find a free slot instead of one a batch line holds, no queue
        of lines before them, and fewer rows beside theirs in every step. Returns the line's
        count against the free slots; the line's slot and count are the caller's to give back
        (`free`). Cancelled, it gives back what it took: a slot kept would leave one fewer for
        every later line, and none at all after `concurrency` such cancels."""
        through_pipeline = batch.endpoint != VIDEOS  # a video line's job runs on the job runner
        await self._slots.acquire()
        try:
            while True:
                running = self.metrics.registry.get_sample_value("omni_gateway_batch_lines_running") or 0.0
                within = running + self.spec.live_priority * self._live() < self.spec.concurrency
                if within and (not through_pipeline or self._pipeline.free_at_entry() > self.unrouted):
                    return Unrouted(self if through_pipeline else None)
                await asyncio.sleep(LIVE_POLL_S)
        except BaseException:
            self._slots.release()
            raise

    def free(self, unrouted: Unrouted) -> None:
        """A line let through (`room`) has ended, started or not: its count and its slot go."""
        unrouted()
        self._slots.release()

    async def answer(self, batch: Batch, line: InputLine, unrouted: Unrouted) -> tuple[bool, bytes]:
        """Whether the line succeeded, and its line of the output or error file."""
        BATCH_PRIORITY.set(BATCH_LINE_PRIORITY)  # this line's task's own context: its request only
        ON_ROUTED.set(unrouted)  # and the attempt that picks its replicas says so
        try:
            if line.body.get("stream"):
                refused = BadRequest("stream: a batch request cannot stream", param="stream")
                return False, answered(line.custom_id, refused.status, None, refused.body())
            if batch.endpoint == VIDEOS:
                return await self._video(batch, line)
            self._in_pipeline += 1
            try:
                r = await self._client.post(batch.endpoint, json=line.body, headers=_on(batch))
            finally:
                self._in_pipeline -= 1
            return _outcome(line, r)
        except Exception as exc:  # the app answers every error itself: this is a crash of ours
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the app swallowed our cancel: not the line's fault
                raise asyncio.CancelledError from exc
            log.exception("batch %s line %d", batch.id, line.index)
            return False, not_run(line.custom_id, "internal_error", f"{type(exc).__name__}: {exc}")

    async def _video(self, batch: Batch, line: InputLine) -> tuple[bool, bytes]:
        """A video line: its job made (or found, by its id, if the batch was taken up again) and
        waited for; its output line the finished job, whose video the owner downloads from
        /v1/videos/{id}/content; a job that failed goes to the error file."""
        job_id = line_video_id(batch.id, line.custom_id)
        r = await self._client.get(f"{VIDEOS}/{job_id}", headers=_on(batch))
        if r.status_code == 404:
            r = await self._client.post(VIDEOS, json=line.body, headers={**_on(batch), JOB_ID_HEADER: job_id})
        while r.is_success and r.json()["status"] in ("queued", "in_progress"):
            await asyncio.sleep(VIDEO_POLL_S)
            r = await self._client.get(f"{VIDEOS}/{job_id}", headers=_on(batch))
        ok, out = _outcome(line, r)
        if ok and (error := r.json().get("error")) is not None:  # the job ran and failed
            return False, answered(line.custom_id, r.status_code, None, msgspec.Raw(r.content), error)
        return ok, out

    async def abandon(self, batch: Batch, lines: list[InputLine]) -> None:
        """Lines that will not run now (their batch cancelled or expired): a video line's job,
        made but unfinished, is deleted (its run ends, wherever it runs)."""
        if batch.endpoint != VIDEOS:
            return
        for line in lines:
            await self._client.delete(
                f"{VIDEOS}/{line_video_id(batch.id, line.custom_id)}", headers=_on(batch)
            )


def line_video_id(batch_id: str, custom_id: str) -> str:
    """The id of a video line's job: the same however often the line runs."""
    digest = hashlib.sha256(f"{batch_id}/{custom_id}".encode()).hexdigest()
    return f"video_{digest[:24]}"


def _on(batch: Batch) -> dict[str, str]:
    """A line's request's headers: the batch it runs for (in the logs) and whom it acts for."""
    return {INTERNAL_HEADER: batch.id, ON_BEHALF_HEADER: batch.owner}


def _outcome(line: InputLine, r: httpx.Response) -> tuple[bool, bytes]:
    body: Any
    if r.headers.get("content-type", "").startswith("application/json"):
        body = msgspec.Raw(r.content)  # kept as it came: an answer with audio is large
    else:  # speech: the audio itself
        body = {
            "audio": base64.b64encode(r.content).decode(),
            "content_type": r.headers.get("content-type"),
        }
    return r.is_success, answered(line.custom_id, r.status_code, r.headers.get("x-request-id"), body)
