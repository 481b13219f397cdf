"""The video job store of Distributed mode and Kubernetes: NATS JetStream, which the pipeline
already runs on. Jobs in a key-value bucket (`omni-videos-<pipeline>`), one key per job;
their files in an object store (`omni-videos-<pipeline>-files`), `<id>/<variant>`.

Every gateway follows the bucket (omni_gateway.jetstream.FollowedBucket: a local mirror, and
every write a compare-and-set, so one claim of a job wins).

Limits are counted on the mirror: two gateways taking jobs at the same moment may each let
one job past a limit. A file is served from a local copy, fetched whole from the object store
on its first read (range requests are answered from that copy); every gateway drops its copies
of a job's files when the watch tells it the job is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import nats.js
import nats.js.errors
from nats.aio.client import Client as NatsClient

from omni_gateway.jetstream import FollowedBucket, local_copy
from omni_gateway.videos.store import RUNNABLE, StoreFull, VideoJob


class JetStreamJobStore:
    def __init__(self, jobs: FollowedBucket, files: Any, cache: Path) -> None:
        self._jobs, self._files, self._cache = jobs, files, cache

    @classmethod
    async def open(cls, nc: NatsClient, pipeline: str, cache: Path) -> JetStreamJobStore:
        js = nc.jetstream()
        bucket = f"omni-videos-{pipeline}"
        try:
            files = await js.object_store(f"{bucket}-files")
        except nats.js.errors.BucketNotFoundError:
            files = await js.create_object_store(f"{bucket}-files")

        async def drop_copies(job_id: str) -> None:
            """A job deleted anywhere (by a client, or at its expiry) takes this gateway's local
            copies of its files with it."""
            await asyncio.to_thread(shutil.rmtree, cache / job_id, True)

        return cls(await FollowedBucket.open(js, bucket, drop_copies), files, cache)

    async def close(self) -> None:
        await self._jobs.close()

    def _records(self) -> list[tuple[str, dict[str, Any], int]]:
        return self._jobs.live()

    async def add(self, job: VideoJob, max_queued: int, max_per_owner: int) -> None:
        runnable = [r for _, r, _ in self._records() if r["status"] in RUNNABLE]
        if len(runnable) >= max_queued:
            raise StoreFull("all", max_queued)
        if sum(r["owner"] == job.owner for r in runnable) >= max_per_owner:
            raise StoreFull("key", max_per_owner)
        record = {
            **msgspec.structs.asdict(job),
            "holder": None,
            "lease_until": None,
            "created_ns": time.time_ns(),
        }
        await self._jobs.create(job.id, record)

    async def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        record = self._jobs.get(job_id)[0]
        if record is None or (owner is not None and record["owner"] != owner):
            return None
        return _job(record)

    async def page(
        self, owner: str, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[VideoJob], bool]:
        mine = sorted(
            (r for _, r, _ in self._records() if r["owner"] == owner),
            key=lambda r: r["created_ns"],
            reverse=not ascending,
        )
        if after is not None:
            at = next((k for k, r in enumerate(mine) if r["id"] == after), None)
            if at is None:
                raise KeyError(after)
            mine = mine[at + 1 :]
        return [_job(r) for r in mine[:limit]], len(mine) > limit

    async def delete(self, job_id: str, owner: str) -> bool:
        record, _ = self._jobs.get(job_id)
        if record is None or record["owner"] != owner:
            return False
        return await self._jobs.delete(job_id)

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[VideoJob]:
        free = sorted(
            (
                (r, rev)
                for _, r, rev in self._records()
                if r["status"] in RUNNABLE and (r["lease_until"] is None or r["lease_until"] < now)
            ),
            key=lambda x: x[0]["created_ns"],
        )
        claimed: list[VideoJob] = []
        for record, revision in free:
            if len(claimed) >= limit:
                break
            mine = {**record, "holder": holder, "lease_until": now + lease_s}
            if await self._jobs.write(record["id"], mine, revision):
                claimed.append(_job(mine))
        return claimed

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        held: set[str] = set()
        for job_id in ids:
            record, revision = self._jobs.get(job_id)
            if record is None or record["holder"] != holder:
                continue
            if await self._jobs.write(job_id, {**record, "lease_until": until}, revision):
                held.add(job_id)
        return held

    async def update(self, job_id: str, by: str, **values: Any) -> bool:
        for _ in range(3):  # a stale copy (another's write not yet seen) is read again
            record, revision = self._jobs.get(job_id)
            if record is None or record["holder"] != by:
                return False
            if await self._jobs.write(job_id, {**record, **values}, revision):
                return True
            await self._jobs.reload(job_id)
        return False

    async def release(self, holder: str, ids: list[str]) -> None:
        for job_id in ids:
            record = self._jobs.get(job_id)[0]
            if record is not None and record["status"] in RUNNABLE:
                await self.update(job_id, holder, status="queued", progress=0, lease_until=None, holder=None)

    async def expired(self, now: float) -> list[str]:
        gone: list[str] = []
        for job_id, record, revision in self._records():
            expired = record["expires_at"] is not None and record["expires_at"] <= now
            if expired and await self._jobs.delete(job_id, last=revision):  # not if changed meanwhile
                gone.append(job_id)
        return gone

    async def ids(self) -> set[str]:
        return {i for i, _, _ in self._records()}

    async def put_files(self, job_id: str, files: dict[str, bytes]) -> None:
        """All of them before the job says it has completed, which is what makes them visible."""
        for name, data in files.items():
            await self._files.put(f"{job_id}/{name}", data)

    async def file(self, job_id: str, name: str) -> Path | None:
        """A local copy of the file (fetched whole on its first read), or None if there is none."""
        return await local_copy(self._files, f"{job_id}/{name}", self._cache / job_id / name)

    async def remove_files(self, job_ids: list[str]) -> None:
        names = {o.name for o in await self._object_list()}
        for job_id in job_ids:
            for name in [n for n in names if n.startswith(f"{job_id}/")]:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self._files.delete(name)
            await asyncio.to_thread(shutil.rmtree, self._cache / job_id, True)

    async def file_ids(self) -> set[str]:
        return {o.name.split("/", 1)[0] for o in await self._object_list()}

    async def _object_list(self) -> list[Any]:
        try:
            return list(await self._files.list(ignore_deletes=True))
        except nats.js.errors.NotFoundError:  # an empty store
            return []


def _job(record: dict[str, Any]) -> VideoJob:
    return VideoJob(**{k: record[k] for k in VideoJob.__struct_fields__})
