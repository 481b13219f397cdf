"""The video job runner: takes jobs from the store and runs them through the pipeline.

Up to `concurrency` jobs run at once per gateway. Every `lease_s / 3` (and whenever a job is
made or ends) the runner renews the leases of the jobs it runs, cancels those it no longer
holds (deleted, or claimed by another after a stall), claims what it has room for (new jobs,
and those of a gateway that died), and deletes what has expired. A job's progress follows its
denoising steps. A job the pipeline cannot take now (every replica full, none up) waits and is
tried again; one the pipeline fails is `failed` with the error. A gateway that stops gives its
running jobs back, queued, for the next gateway to take at once; one that dies leaves them to
the next after their lease lapses. Either way the job runs again from the start, with the
same seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from pathlib import Path
from typing import Final

from omni_gateway.errors import OmniError, Overloaded, StageFailed, Unavailable
from omni_gateway.events import VideoProgress
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.preflight import check_clip
from omni_gateway.protocol.videos import VideoCreateRequest, video_inputs, video_sampling
from omni_gateway.request import PipelineRequest
from omni_gateway.videos.jetstream_store import JetStreamJobStore
from omni_gateway.videos.media import FILE_NAMES, encode_mp4, encode_spritesheet, encode_thumbnail
from omni_gateway.videos.sqlite_store import SqliteJobStore
from omni_gateway.videos.store import JobStore, VideoJob
from omni_pipeline.settings import VideoJobsSpec
from omni_pipeline.spec import Mode, OutputKind

log = logging.getLogger("omni.gateway.videos")

RETRY_S: Final = 2.0
"""How long a job the pipeline could not take waits before it is tried again."""


def asked_of(req: VideoCreateRequest, progress: bool) -> PipelineRequest:
    return PipelineRequest(
        req.model,
        frozenset({OutputKind.VIDEO}),
        video_inputs(req),
        video_sampling(req, progress),
        priority=req.priority,
    )


async def checked(pipeline: Pipeline, req: VideoCreateRequest, progress: bool) -> PipelineRequest:
    """The request, once checked as far as it can be before it runs: the pipeline's checks, and
    what its video stages have said they can make (a 400 naming the field)."""
    asked = asked_of(req, progress)
    await pipeline.prepare(asked)
    width, height = req.width_height()
    seconds = float(req.seconds) if req.seconds is not None else None
    check_clip(pipeline.announced, width, height, seconds, req.fps, req.num_frames)
    return asked


def clip_figures(video: VideoProgress) -> tuple[str, str]:
    """A finished clip's `size` (WxH) and `seconds`, as its resource shows them."""
    frames, height, width, _ = video.videos[0].shape
    return f"{width}x{height}", f"{(frames - 1) / video.fps:g}"


def encoded_files(video: VideoProgress) -> dict[str, bytes]:
    """Each content variant's bytes (the MP4, its thumbnail and spritesheet)."""
    frames = video.videos[0]
    return {
        "video": encode_mp4(frames, video.fps),
        "thumbnail": encode_thumbnail(frames),
        "spritesheet": encode_spritesheet(frames),
    }


class VideoJobs:
    def __init__(
        self, pipeline: Pipeline, spec: VideoJobsSpec, store: JobStore, metrics: GatewayMetrics
    ) -> None:
        self.pipeline, self.spec, self.store, self.metrics = pipeline, spec, store, metrics
        self.holder = f"{pipeline.gateway_id}-{secrets.token_hex(4)}"
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    async def open(cls, pipeline: Pipeline, name: str, metrics: GatewayMetrics) -> VideoJobs:
        """The jobs of pipeline `name`, in the store its mode keeps them in (`store: auto`:
        SQLite in SingleNode, JetStream otherwise)."""
        spec = pipeline.spec.gateway.videos
        kind = spec.store
        if kind == "auto":
            kind = "sqlite" if pipeline.spec.mode is Mode.SINGLE_NODE else "jetstream"
        root = Path(spec.state_dir) / name
        store: JobStore
        if kind == "sqlite":
            store = await asyncio.to_thread(SqliteJobStore, root)
        else:
            store = await JetStreamJobStore.open(pipeline.nats, name, root / "cache")
        log.info("video jobs: kept in %s", "SQLite under " + str(root) if kind == "sqlite" else "JetStream")
        return cls(pipeline, spec, store, metrics)

    async def start(self) -> None:
        """Take jobs up from now on; first delete the files of jobs no longer in the store (a
        gateway that died between deleting a job and its files)."""
        stray = await self.store.file_ids() - await self.store.ids()
        await self.store.remove_files(sorted(stray))
        self._loop = asyncio.create_task(self._taking(), name="video-jobs")

    async def stop(self) -> None:
        """Stop taking jobs, end those running here and give them back, queued."""
        self._stopping = True
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        running = list(self._running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.store.release(self.holder, [t.get_name() for t in running])
        await self.store.close()

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """End the job's run here, if it runs here (it was deleted)."""
        if (task := self._running.get(job_id)) is not None:
            task.cancel()

    async def _taking(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # the store unreachable, or its disk full: say so, and look again
                log.exception("video jobs: taking jobs failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.spec.lease_s / 3):
                    await self._wake.wait()
            self._wake.clear()

    async def _tick(self) -> None:
        now = time.time()
        held = await self.store.renew(self.holder, list(self._running), now + self.spec.lease_s)
        for job_id in set(self._running) - held:
            self._running[job_id].cancel()  # deleted, or another took it after our lease lapsed
        if (room := self.spec.concurrency - len(self._running)) > 0:
            for job in await self.store.claim(self.holder, now, self.spec.lease_s, room):
                self._running[job.id] = asyncio.create_task(self._run(job), name=job.id)
        if expired := await self.store.expired(now):
            await self.store.remove_files(expired)
            log.info("video jobs: %d expired and deleted", len(expired))

    async def _run(self, job: VideoJob) -> None:
        async def update(**values: object) -> bool:
            return await self.store.update(job.id, self.holder, **values)

        t0 = time.monotonic()
        outcome = "lost"
        self.metrics.video_jobs_running.inc()
        try:
            await update(status="in_progress", progress=0)
            req = VideoCreateRequest.model_validate(job.request)
            prepared = await self.pipeline.prepare(asked_of(req, progress=True))
            final: VideoProgress | None = None
            shown = 0
            rid = f"{job.id}-{secrets.token_hex(3)}"
            run = self.pipeline.run(rid, prepared, timeout_s=self.spec.timeout_s)
            async with contextlib.aclosing(run) as events:
                async for ev in events:
                    if not isinstance(ev, VideoProgress):
                        continue
                    if ev.is_last:
                        final = ev
                    elif (pct := min(99, ev.step * 100 // max(1, ev.steps))) > shown:
                        shown = pct
                        await update(progress=pct)
            if final is None or not final.videos:
                raise StageFailed("the pipeline ended without a video")
            size, seconds = clip_figures(final)
            files = await asyncio.to_thread(encoded_files, final)
            if (n := len(files["video"])) > self.spec.max_video_bytes:
                raise StageFailed(
                    f"the video is {n} bytes, more than this server keeps ({self.spec.max_video_bytes})",
                    code="video_too_large",
                )
            await self.store.put_files(job.id, {FILE_NAMES[v]: data for v, data in files.items()})
            done = int(time.time())
            expires = done + int(self.spec.retention_s)
            if not await update(
                status="completed",
                progress=100,
                completed_at=done,
                expires_at=expires,
                size=size,
                seconds=seconds,
            ):  # deleted meanwhile: its files go too
                await self.store.remove_files([job.id])
                return
            outcome = "completed"
            self.metrics.video_job_seconds.observe(time.monotonic() - t0)
            log.info("video job %s completed (%s, %s s)", job.id, size, seconds)
        except asyncio.CancelledError:
            outcome = "given_back" if self._stopping else "lost"
            raise
        except (Overloaded, Unavailable) as exc:  # the pipeline is busy or restarting: wait
            log.info("video job %s waits: %s", job.id, exc.message)
            outcome = "requeued"
            await update(status="queued", progress=0, lease_until=time.time() + RETRY_S)
        except Exception as exc:
            err = exc if isinstance(exc, OmniError) else None
            if err is None:
                log.exception("video job %s failed", job.id)
            outcome = "failed"
            done = int(time.time())
            await update(
                status="failed",
                completed_at=done,
                expires_at=done + int(self.spec.retention_s),
                error={
                    "code": (err.code if err and err.code else "internal_error"),
                    "message": err.message if err else f"internal error: {type(exc).__name__}",
                },
            )
        finally:
            self.metrics.video_jobs_running.dec()
            self.metrics.video_jobs.labels(outcome=outcome).inc()
            self._running.pop(job.id, None)
            self._wake.set()
