"""The Batch API's store for `omni serve`: files, batches and each line's outcome in SQLite, a
file's bytes beside it, under the state directory, so all of it outlives the gateway.

A batch running is leased by one gateway (a claim is one UPDATE: one claim wins). A line's
outcome is inserted once, keyed by its batch and index, and its batch's counts move in the same
transaction, so a line run again after a gateway died (its outcome never written) counts and
lands once. A file's bytes are written beside their final name and renamed into place before
its row exists: a listed file always has its bytes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any, Final

import msgspec

from omni_gateway.batches.records import RUNNABLE, Batch, LineResult, StoredFile
from omni_gateway.sqlite_db import SqliteDb

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    record TEXT NOT NULL,
    holder TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS batches_runnable ON batches (status, lease_until);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""
_FILE_COLUMNS: Final = tuple(StoredFile.__struct_fields__)


def _file(row: Any) -> StoredFile:
    return StoredFile(**{k: row[k] for k in _FILE_COLUMNS})


def _batch(row: Any) -> Batch:
    return msgspec.json.decode(row["record"], type=Batch)


class _Rows(SqliteDb):
    """The tables (blocking calls)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA)

    def add_file(self, f: StoredFile) -> None:
        with self._locked() as db:
            marks = ", ".join("?" * len(_FILE_COLUMNS))
            db.execute(
                f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES ({marks})", msgspec.structs.astuple(f)
            )

    def get_file(self, file_id: str, owner: str | None) -> StoredFile | None:
        with self._locked() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None or (owner is not None and row["owner"] != owner) else _file(row)

    def page(
        self,
        table: str,
        owner: str,
        after: str | None,
        limit: int,
        ascending: bool,
        purpose: str | None = None,
    ) -> tuple[list[Any], bool]:
        op, order = (">", "ASC") if ascending else ("<", "DESC")
        with self._locked() as db:
            start = None
            if after is not None:
                row = db.execute(
                    f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner)
                ).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row["seq"]
            rows = db.execute(
                f"SELECT * FROM {table} WHERE owner = ? AND (? IS NULL OR seq {op} ?)"
                f"{' AND purpose = ?' if purpose else ''} ORDER BY seq {order} LIMIT ?",
                (owner, start, start, *([purpose] if purpose else []), limit + 1),
            ).fetchall()
        convert = _file if table == "files" else _batch
        return [convert(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._locked() as db:
            return db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0

    def expired_files(self, now: float) -> list[str]:
        with self._locked() as db:
            rows = db.execute(
                "DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id", (now,)
            ).fetchall()
        return [r["id"] for r in rows]

    def file_ids(self) -> set[str]:
        with self._locked() as db:
            return {r["id"] for r in db.execute("SELECT id FROM files").fetchall()}

    def add_batch(self, b: Batch) -> None:
        with self._locked() as db:
            db.execute(
                "INSERT INTO batches (id, owner, status, record) VALUES (?, ?, ?, ?)",
                (b.id, b.owner, b.status, msgspec.json.encode(b)),
            )

    def get_batch(self, batch_id: str, owner: str | None) -> Batch | None:
        with self._locked() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None or (owner is not None and row["owner"] != owner) else _batch(row)

    def change(
        self, batch_id: str, holder: str | None, only_if: tuple[str, ...] | None, values: dict[str, Any]
    ) -> Batch | None:
        """Set a batch's fields, if `holder` holds it (None: whoever does) and its status is one
        of `only_if` (None: any); the batch as it is then."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (holder is not None and row["holder"] != holder):
                return None
            if only_if is not None and row["status"] not in only_if:
                return None
            b = msgspec.structs.replace(_batch(row), **values)
            db.execute(
                "UPDATE batches SET status = ?, record = ? WHERE id = ?",
                (b.status, msgspec.json.encode(b), b.id),
            )
            return b

    def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[Batch]:
        rows = self.claim_rows("batches", RUNNABLE, holder, now, lease_s, limit)
        return sorted((_batch(r) for r in rows), key=lambda b: b.created_at)

    def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        return self.renew_leases("batches", holder, ids, until)

    def release(self, holder: str, ids: list[str]) -> None:
        if not ids:
            return
        marks = ",".join("?" * len(ids))
        with self._locked() as db:
            db.execute(
                f"UPDATE batches SET holder = NULL, lease_until = NULL WHERE holder = ? AND id IN ({marks})",
                (holder, *ids),
            )

    def add_result(self, batch_id: str, holder: str, result: LineResult) -> Batch | None:
        """A line's outcome, once: the batch with its counts moved (None: not held by `holder`,
        or the line already has one)."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["holder"] != holder:
                return None
            added = db.execute(
                "INSERT OR IGNORE INTO results (batch_id, line, ok, body) VALUES (?, ?, ?, ?)",
                (batch_id, result.index, int(result.ok), result.line),
            ).rowcount
            if not added:
                return None
            b = _batch(row)
            b = msgspec.structs.replace(
                b, completed=b.completed + result.ok, failed=b.failed + (not result.ok)
            )
            db.execute("UPDATE batches SET record = ? WHERE id = ?", (msgspec.json.encode(b), batch_id))
            return b

    def results(self, batch_id: str) -> list[LineResult]:
        with self._locked() as db:
            rows = db.execute(
                "SELECT line, ok, body FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
            ).fetchall()
        return [LineResult(r["line"], bool(r["ok"]), bytes(r["body"])) for r in rows]

    def drop_results(self, batch_id: str) -> None:
        with self._locked() as db:
            db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))


class SqliteBatchStore:
    def __init__(self, root: Path) -> None:
        self._rows = _Rows(root / "batches.sqlite3")
        self._files = root / "files"
        self._files.mkdir(parents=True, exist_ok=True)

    async def add_file(self, f: StoredFile, data: bytes) -> None:
        def write() -> None:
            staging = self._files / f".{f.id}.{secrets.token_hex(4)}"
            staging.write_bytes(data)
            os.replace(staging, self._files / f.id)
            self._rows.add_file(f)

        await asyncio.to_thread(write)

    async def get_file(self, file_id: str, owner: str | None) -> StoredFile | None:
        return await asyncio.to_thread(self._rows.get_file, file_id, owner)

    async def files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[StoredFile], bool]:
        return await asyncio.to_thread(self._rows.page, "files", owner, after, limit, ascending, purpose)

    async def content(self, file_id: str) -> Path | None:
        path = self._files / file_id
        return path if await asyncio.to_thread(path.is_file) else None

    async def delete_file(self, file_id: str, owner: str) -> bool:
        deleted = await asyncio.to_thread(self._rows.delete_file, file_id, owner)
        if deleted:
            await self._remove([file_id])
        return deleted

    async def expire_files(self, now: float) -> None:
        await self._remove(await asyncio.to_thread(self._rows.expired_files, now))

    async def sweep(self) -> None:
        """Remove bytes whose file row is gone (a gateway that died between the two)."""

        def stray() -> list[str]:
            known = self._rows.file_ids()
            return [
                p.name for p in self._files.iterdir() if not p.name.startswith(".") and p.name not in known
            ]

        await self._remove(await asyncio.to_thread(stray))

    async def _remove(self, file_ids: list[str]) -> None:
        def remove() -> None:
            for file_id in file_ids:
                (self._files / file_id).unlink(missing_ok=True)

        await asyncio.to_thread(remove)

    async def add_batch(self, b: Batch) -> None:
        await asyncio.to_thread(self._rows.add_batch, b)

    async def get_batch(self, batch_id: str, owner: str | None) -> Batch | None:
        return await asyncio.to_thread(self._rows.get_batch, batch_id, owner)

    async def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        return await asyncio.to_thread(self._rows.page, "batches", owner, after, limit, False)

    async def change(
        self, batch_id: str, holder: str | None, only_if: tuple[str, ...] | None = None, **values: Any
    ) -> Batch | None:
        return await asyncio.to_thread(self._rows.change, batch_id, holder, only_if, values)

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[Batch]:
        return await asyncio.to_thread(self._rows.claim, holder, now, lease_s, limit)

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        return await asyncio.to_thread(self._rows.renew, holder, ids, until)

    async def release(self, holder: str, ids: list[str]) -> None:
        await asyncio.to_thread(self._rows.release, holder, ids)

    async def add_result(self, batch_id: str, holder: str, result: LineResult) -> Batch | None:
        return await asyncio.to_thread(self._rows.add_result, batch_id, holder, result)

    async def results(self, batch_id: str) -> list[LineResult]:
        return await asyncio.to_thread(self._rows.results, batch_id)

    async def drop_results(self, batch_id: str) -> None:
        await asyncio.to_thread(self._rows.drop_results, batch_id)

    async def close(self) -> None:
        self._rows.close()
