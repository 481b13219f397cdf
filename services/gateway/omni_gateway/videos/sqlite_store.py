"""The video job store of `omni serve`: SQLite and files under the state directory, so jobs
outlive the gateway process (a restart lists them, serves their files and takes unfinished
ones up again). A claim is one UPDATE in SQLite's own transaction, so one claim wins, between
gateway processes too. A job's files are written to a staging directory renamed into place,
so a reader sees all of them or none.

SQLite blocks on the disk: `_Rows` does the SQL (omni_gateway.sqlite_db), and `SqliteJobStore`
calls it in a thread.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Final

import msgspec

from omni_gateway.sqlite_db import SqliteDb
from omni_gateway.videos.store import RUNNABLE, StoreFull, VideoJob

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    request TEXT NOT NULL,
    error TEXT,
    remixed_from TEXT,
    holder TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS jobs_runnable ON jobs (status, lease_until);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at);
"""


_COLUMNS: Final = tuple(VideoJob.__struct_fields__)


def _row(row: sqlite3.Row) -> VideoJob:
    values = {k: row[k] for k in _COLUMNS}
    values["request"] = json.loads(values["request"])
    values["error"] = json.loads(values["error"]) if values["error"] else None
    return VideoJob(**values)


class _Rows(SqliteDb):
    """The jobs table (blocking calls)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA)

    def add(self, job: VideoJob, max_queued: int, max_per_owner: int) -> None:
        """Store a new job, unless the owner's or everyone's unfinished jobs are at their limit."""
        marks = ",".join("?" * len(RUNNABLE))
        with self._transaction() as db:
            (total,) = db.execute(f"SELECT count(*) FROM jobs WHERE status IN ({marks})", RUNNABLE).fetchone()
            if total >= max_queued:
                raise StoreFull("all", max_queued)
            (own,) = db.execute(
                f"SELECT count(*) FROM jobs WHERE owner = ? AND status IN ({marks})", (job.owner, *RUNNABLE)
            ).fetchone()
            if own >= max_per_owner:
                raise StoreFull("key", max_per_owner)
            values = msgspec.structs.asdict(job)
            values["request"] = json.dumps(values["request"])
            values["error"] = json.dumps(values["error"]) if values["error"] else None
            db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                tuple(values[k] for k in _COLUMNS),
            )

    def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        """The job, if it exists and is `owner`'s (None: anyone's)."""
        with self._locked() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return _row(row)

    def page(self, owner: str, after: str | None, limit: int, ascending: bool) -> tuple[list[VideoJob], bool]:
        """Up to `limit` of the owner's jobs in creation order (or its reverse), from the one
        after `after`; and whether more follow."""
        op, order = (">", "ASC") if ascending else ("<", "DESC")
        with self._locked() as db:
            start = None
            if after is not None:
                row = db.execute("SELECT seq FROM jobs WHERE id = ? AND owner = ?", (after, owner)).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row["seq"]
            rows = db.execute(
                f"SELECT * FROM jobs WHERE owner = ? AND (? IS NULL OR seq {op} ?) "
                f"ORDER BY seq {order} LIMIT ?",
                (owner, start, start, limit + 1),
            ).fetchall()
        return [_row(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str, owner: str) -> bool:
        with self._locked() as db:
            return db.execute("DELETE FROM jobs WHERE id = ? AND owner = ?", (job_id, owner)).rowcount > 0

    def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[VideoJob]:
        """Lease up to `limit` unfinished jobs no live gateway holds (oldest first) to `holder`."""
        rows = self.claim_rows("jobs", RUNNABLE, holder, now, lease_s, limit)
        return sorted((_row(r) for r in rows), key=lambda j: j.created_at)

    def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        return self.renew_leases("jobs", holder, ids, until)

    def update(self, job_id: str, by: str, **values: Any) -> bool:
        if "error" in values:
            values["error"] = json.dumps(values["error"]) if values["error"] else None
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._locked() as db:
            cur = db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND holder = ?", (*values.values(), job_id, by)
            )
            return cur.rowcount > 0

    def release(self, holder: str, ids: list[str]) -> None:
        """Give unfinished jobs back, queued, for the next gateway to take at once (a graceful stop)."""
        if not ids:
            return
        marks = ",".join("?" * len(ids))
        with self._locked() as db:
            db.execute(
                f"UPDATE jobs SET status = 'queued', progress = 0, holder = NULL, lease_until = NULL "
                f"WHERE holder = ? AND id IN ({marks}) AND status IN ('queued', 'in_progress')",
                (holder, *ids),
            )

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs past their expiry; their ids (whose files go next)."""
        with self._locked() as db:
            rows = db.execute(
                "DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id", (now,)
            ).fetchall()
        return [r["id"] for r in rows]

    def ids(self) -> set[str]:
        with self._locked() as db:
            return {r["id"] for r in db.execute("SELECT id FROM jobs").fetchall()}


class SqliteJobStore:
    def __init__(self, root: Path) -> None:
        self._rows = _Rows(root / "jobs.sqlite3")
        self._files = root / "videos"
        self._files.mkdir(parents=True, exist_ok=True)

    async def add(self, job: VideoJob, max_queued: int, max_per_owner: int) -> None:
        await asyncio.to_thread(self._rows.add, job, max_queued, max_per_owner)

    async def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        return await asyncio.to_thread(self._rows.get, job_id, owner)

    async def page(
        self, owner: str, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[VideoJob], bool]:
        return await asyncio.to_thread(self._rows.page, owner, after, limit, ascending)

    async def delete(self, job_id: str, owner: str) -> bool:
        return await asyncio.to_thread(self._rows.delete, job_id, owner)

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[VideoJob]:
        return await asyncio.to_thread(self._rows.claim, holder, now, lease_s, limit)

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        return await asyncio.to_thread(self._rows.renew, holder, ids, until)

    async def update(self, job_id: str, by: str, **values: Any) -> bool:
        return await asyncio.to_thread(lambda: self._rows.update(job_id, by, **values))

    async def release(self, holder: str, ids: list[str]) -> None:
        await asyncio.to_thread(self._rows.release, holder, ids)

    async def expired(self, now: float) -> list[str]:
        return await asyncio.to_thread(self._rows.expired, now)

    async def ids(self) -> set[str]:
        return await asyncio.to_thread(self._rows.ids)

    async def put_files(self, job_id: str, files: dict[str, bytes]) -> None:
        def write() -> None:
            staging = self._files / f".{job_id}.{secrets.token_hex(4)}"
            staging.mkdir()
            try:
                for name, data in files.items():
                    (staging / name).write_bytes(data)
                shutil.rmtree(self._files / job_id, ignore_errors=True)  # an earlier run's, cut short
                staging.rename(self._files / job_id)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

        await asyncio.to_thread(write)

    async def file(self, job_id: str, name: str) -> Path | None:
        path = self._files / job_id / name
        return path if await asyncio.to_thread(path.is_file) else None

    async def remove_files(self, job_ids: list[str]) -> None:
        def remove() -> None:
            for job_id in job_ids:
                shutil.rmtree(self._files / job_id, ignore_errors=True)

        await asyncio.to_thread(remove)

    async def file_ids(self) -> set[str]:
        def listed() -> set[str]:
            return {p.name for p in self._files.iterdir() if not p.name.startswith(".")}

        return await asyncio.to_thread(listed)

    async def close(self) -> None:
        self._rows.close()
