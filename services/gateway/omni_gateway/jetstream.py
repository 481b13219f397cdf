"""The JetStream key-value buckets a gateway keeps state in (video jobs, uploaded voices,
batches): opened where they exist, made where they do not yet (the first gateway of a pipeline
makes them); a bucket every gateway mirrors and writes by compare-and-set; and local copies of
what their object stores hold, to serve and read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import nats.js.errors

DELETE_OPS: Final = ("DEL", "PURGE")
"""A key-value entry's operations that say its key is gone."""
Record = dict[str, Any]


async def key_value(js: Any, bucket: str) -> Any:
    """The bucket, one revision a key kept (every write is a compare-and-set on it)."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, history=1)


class FollowedBucket:
    """A key-value bucket of JSON records that every gateway mirrors: loaded whole at open, then
    followed by a watch, so reading, listing and counting are local. Every write is a
    compare-and-set on the key's revision: one made on a stale copy fails instead of overwriting
    another gateway's, so of two claims one wins. The mirror takes this gateway's own writes at
    once and ignores what the watch brings of revisions it already has; a deleted key's record
    is kept as None, so a late older revision does not bring it back."""

    def __init__(self, kv: Any, on_deleted: Callable[[str], Awaitable[None]] | None) -> None:
        self._kv, self._on_deleted = kv, on_deleted
        self._records: dict[str, tuple[Record | None, int]] = {}
        self._watcher: Any = None
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, js: Any, bucket: str, on_deleted: Callable[[str], Awaitable[None]] | None = None
    ) -> FollowedBucket:
        """The bucket loaded; `on_deleted(key)` runs for each key the watch then sees deleted
        (by any gateway)."""
        followed = cls(await key_value(js, bucket), on_deleted)
        followed._watcher = await followed._kv.watchall()
        while (entry := await followed._watcher.updates(timeout=30)) is not None:
            followed._seen(entry)
        followed._watch = asyncio.create_task(followed._following(), name=f"{bucket}-watch")
        return followed

    async def _following(self) -> None:
        async for entry in self._watcher:
            if entry is not None:
                self._seen(entry)
                if self._on_deleted is not None and entry.operation in DELETE_OPS:
                    await self._on_deleted(entry.key)

    def _seen(self, entry: Any) -> None:
        if (held := self._records.get(entry.key)) is not None and held[1] >= entry.revision:
            return  # our own write, already taken, or older
        gone = entry.operation in DELETE_OPS or not entry.value
        self._records[entry.key] = (None if gone else json.loads(entry.value), entry.revision)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        with contextlib.suppress(Exception):  # the connection may be closing already
            await self._watcher.stop()

    def get(self, key: str) -> tuple[Record | None, int]:
        """The key's record (None: none, or deleted) and the revision it was read at."""
        return self._records.get(key, (None, 0))

    def live(self, prefix: str = "") -> list[tuple[str, Record, int]]:
        """(key, record, revision) of every key under `prefix` that is not deleted."""
        held = self._records.items()
        return [(k, r, rev) for k, (r, rev) in held if r is not None and k.startswith(prefix)]

    async def write(self, key: str, record: Record, revision: int) -> bool:
        """Compare-and-set: False where another write came first."""
        try:
            new = await self._kv.update(key, json.dumps(record).encode(), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        self._records[key] = (record, new)
        return True

    async def create(self, key: str, record: Record) -> None:
        """Write a key that must not exist (KeyWrongLastSequenceError where it does)."""
        self._records[key] = (record, await self._kv.create(key, json.dumps(record).encode()))

    async def reload(self, key: str) -> None:
        """Read the key again from the bucket: a write failed on a stale copy."""
        try:
            self._seen(await self._kv.get(key))
        except nats.js.errors.NotFoundError:  # deleted, or never there
            self._records[key] = (None, self.get(key)[1])

    async def delete(self, key: str, last: int | None = None) -> bool:
        """Delete the key (if it is still at revision `last`, where given: else False)."""
        try:
            await self._kv.delete(key, last=last)
        except nats.js.errors.BadRequestError:  # the wrong last revision
            return False
        self._records[key] = (None, self.get(key)[1])  # the watch brings the marker's own revision
        return True


async def local_copy(objects: Any, name: str, path: Path) -> Path | None:
    """`path`, holding object `name` of the store `objects`: fetched whole on its first read,
    written beside and renamed into place (a reader sees all of it or none); None if the store
    has no such object."""
    if await asyncio.to_thread(path.is_file):
        return path
    try:
        got = await objects.get(name)
    except nats.js.errors.ObjectNotFoundError:
        return None

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{time.monotonic_ns()}")
        partial.write_bytes(got.data or b"")
        partial.rename(path)

    await asyncio.to_thread(write)
    return path
