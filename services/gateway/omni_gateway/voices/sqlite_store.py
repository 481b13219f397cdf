"""The voice store of `omni serve`: one SQLite file under the state directory, so voices outlive
the gateway process. An insert is one statement under SQLite's own lock, so of two uploads of
one name one wins, between gateway processes too. SQLite blocks on the disk: every call runs in
a thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Final

from omni_gateway.voices.store import UploadedVoice, VoiceExists, VoicesFull, decode, encode

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS voices (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    record BLOB NOT NULL
);
"""


class SqliteVoiceStore:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(root / "voices.db", check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    @classmethod
    async def open(cls, root: Path) -> SqliteVoiceStore:
        return await asyncio.to_thread(cls, root)

    def _add(self, voice: UploadedVoice, max_voices: int) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT 1 FROM voices WHERE key = ?", (voice.key,)).fetchone():
                    raise VoiceExists(voice.name)
                (held,) = self._db.execute("SELECT count(*) FROM voices").fetchone()
                if held >= max_voices:
                    raise VoicesFull(max_voices)
                self._db.execute("INSERT INTO voices (key, record) VALUES (?, ?)", (voice.key, encode(voice)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _get(self, name: str) -> UploadedVoice | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM voices WHERE key = ?", (name.lower(),)).fetchone()
        return None if row is None else decode(row[0])

    def _all(self) -> list[UploadedVoice]:
        with self._lock:
            rows = self._db.execute("SELECT record FROM voices ORDER BY seq").fetchall()
        return [decode(r[0]) for r in rows]

    def _delete(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM voices WHERE key = ?", (name.lower(),)).rowcount > 0

    async def add(self, voice: UploadedVoice, max_voices: int) -> None:
        await asyncio.to_thread(self._add, voice, max_voices)

    async def get(self, name: str) -> UploadedVoice | None:
        return await asyncio.to_thread(self._get, name)

    async def all(self) -> list[UploadedVoice]:
        return await asyncio.to_thread(self._all)

    async def delete(self, name: str) -> bool:
        return await asyncio.to_thread(self._delete, name)

    async def close(self) -> None:
        await asyncio.to_thread(self._db.close)
