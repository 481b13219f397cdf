"""One SQLite database of the gateway's durable state (video jobs, batches and their files), as
every store of `omni serve` opens it: WAL, each write in a transaction taken at once, one
connection a process shared by threads under a lock. Its calls block on the disk: stores run
them in a thread."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path


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
