"""What a video job store is: the job as it is kept, and what every store does with it
(sqlite_store.py for `omni serve`, jetstream_store.py for Distributed mode and Kubernetes).

A store keeps the jobs and their files. A running job is leased: its gateway renews the lease
while it lives; a job whose lease has lapsed (its gateway died) is claimed by the next gateway
that looks, and one claim wins. Every job belongs to the API key that made it (`owner`, a
digest of the key; one owner for all when keys are off): no key sees another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

RUNNABLE: Final = ("queued", "in_progress")


class VideoJob(msgspec.Struct, frozen=True, kw_only=True):
    """One job as it is stored; `resource()` is how OpenAI's Videos API shows it."""

    id: str
    owner: str
    status: str
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str
    size: str
    seconds: str
    request: dict[str, Any]
    """The create request's fields (its seed drawn), to run it again."""
    error: dict[str, str] | None = None
    remixed_from: str | None = None

    def resource(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "prompt": self.prompt,
            "size": self.size,
            "seconds": self.seconds,
            "remixed_from_video_id": self.remixed_from,
            "error": self.error,
        }


class StoreFull(Exception):
    """No room for another job: `scope` is `key` (the owner's limit) or `all`."""

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(scope)
        self.scope, self.limit = scope, limit


class JobStore(Protocol):
    async def add(self, job: VideoJob, max_queued: int, max_per_owner: int) -> None:
        """Store a new job, unless the owner's or everyone's unfinished jobs are at their limit
        (StoreFull)."""

    async def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        """The job, if it exists and is `owner`'s (None: anyone's)."""

    async def page(
        self, owner: str, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[VideoJob], bool]:
        """Up to `limit` of the owner's jobs in creation order (or its reverse), from the one
        after `after` (KeyError: no such job of the owner's); and whether more follow."""

    async def delete(self, job_id: str, owner: str) -> bool: ...

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[VideoJob]:
        """Lease up to `limit` unfinished jobs no live gateway holds (oldest first) to `holder`."""

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        """Extend the holder's leases on `ids`; the ids it still holds (a deleted job's is gone)."""

    async def update(self, job_id: str, by: str, **values: Any) -> bool:
        """Set a job's fields (status, progress, size, ..., `lease_until`, `holder`) if `by`
        holds it; False if it does not (lost, or deleted)."""

    async def release(self, holder: str, ids: list[str]) -> None:
        """Give unfinished jobs back, queued, for the next gateway to take at once."""

    async def expired(self, now: float) -> list[str]:
        """Delete the finished jobs past their expiry; their ids (whose files go next)."""

    async def ids(self) -> set[str]: ...

    async def put_files(self, job_id: str, files: dict[str, bytes]) -> None:
        """A finished job's files, by name, all of them or none visible."""

    async def file(self, job_id: str, name: str) -> Path | None:
        """A local file of the job's to serve (range requests too); None if there is none."""

    async def remove_files(self, job_ids: list[str]) -> None: ...

    async def file_ids(self) -> set[str]:
        """The jobs that have files (a job deleted without them leaves them stray)."""

    async def close(self) -> None: ...
