"""One SQLite database of the gateway's durable state (video jobs, batches and their files), as
every store of `omni serve` opens it: WAL, each write in a transaction taken at once, one
connection a process shared by threads under a lock; and the leases of a table of work (its
rows' `id`, `seq`, `status`, `holder`, `lease_until`). Its calls block on the disk: stores run
them in a thread."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class SqliteDb:
    def __init__(self, path: Path, schema: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._locked() as db:
            db.execute("PRAGMA journal_mode=WAL")
            # WAL: a process crash loses nothing, a power cut the last writes.
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(schema)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (BEGIN IMMEDIATE): a count and the insert it
        allows are not split by another gateway's insert."""
        with self._locked() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def close(self) -> None:
        with self._locked() as db:
            db.close()

    def claim_rows(
        self, table: str, runnable: tuple[str, ...], holder: str, now: float, lease_s: float, limit: int
    ) -> list[Any]:
        """Lease up to `limit` rows of `table` in a runnable status that no live gateway holds
        (oldest first) to `holder`: one UPDATE, so between gateways one claim wins."""
        marks = ",".join("?" * len(runnable))
        with self._locked() as db:
            return db.execute(
                f"UPDATE {table} SET holder = ?, lease_until = ? WHERE id IN ("
                f" SELECT id FROM {table} WHERE status IN ({marks})"
                f" AND (lease_until IS NULL OR lease_until < ?) ORDER BY seq LIMIT ?) RETURNING *",
                (holder, now + lease_s, *runnable, now, limit),
            ).fetchall()

    def renew_leases(self, table: str, holder: str, ids: list[str], until: float) -> set[str]:
        """Extend the holder's leases on `ids`; the ids it still holds (a deleted row's is gone)."""
        if not ids:
            return set()
        marks = ",".join("?" * len(ids))
        with self._locked() as db:
            rows = db.execute(
                f"UPDATE {table} SET lease_until = ? WHERE holder = ? AND id IN ({marks}) RETURNING id",
                (until, holder, *ids),
            ).fetchall()
        return {r["id"] for r in rows}
