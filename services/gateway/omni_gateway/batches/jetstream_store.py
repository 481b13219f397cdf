"""The batch store of Distributed mode and Kubernetes: NATS JetStream, which the pipeline
already runs on. Files and batches in a key-value bucket (`omni-batches-<pipeline>`, keys
`file.<id>` and `batch.<id>`), each line's outcome as a key of its own in another
(`omni-batches-<pipeline>-results`, `<batch id>.<line>`), and the bytes (files' and outcomes'
lines) in an object store (`omni-batches-<pipeline>-files`).

Every gateway keeps a mirror of the first bucket, fed by a watch of it, so reading and listing
are local. Every write of a batch is a compare-and-set on its key's revision: a claim, a renewal
or a change made on a stale copy fails instead of overwriting another gateway's, so one claim
wins. A line's outcome is recorded by creating its key, which fails if it exists: once only. Its
bytes are put first, so a recorded outcome always has them; its batch's counts move after (a
gateway that dies between the two leaves them one behind, until the next holder counts again).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import msgspec
import nats.js
import nats.js.errors
from nats.aio.client import Client as NatsClient

from omni_gateway.batches.records import RUNNABLE, Batch, LineResult, StoredFile
from omni_gateway.jetstream import DELETE_OPS, FollowedBucket, key_value, local_copy


class JetStreamBatchStore:
    def __init__(self, bucket: FollowedBucket, results: Any, objects: Any, cache: Path) -> None:
        self._bucket, self._results, self._objects, self._cache = bucket, results, objects, cache

    @classmethod
    async def open(cls, nc: NatsClient, pipeline: str, cache: Path) -> JetStreamBatchStore:
        js = nc.jetstream()
        name = f"omni-batches-{pipeline}"
        bucket = await FollowedBucket.open(js, name)
        try:
            results = await key_value(js, f"{name}-results")
            try:
                objects = await js.object_store(f"{name}-files")
            except nats.js.errors.BucketNotFoundError:
                objects = await js.create_object_store(f"{name}-files")
        except BaseException:
            await bucket.close()
            raise
        return cls(bucket, results, objects, cache)

    async def close(self) -> None:
        await self._bucket.close()

    def _live(self, kind: str) -> list[tuple[dict[str, Any], int]]:
        return [(r, rev) for _, r, rev in self._bucket.live(f"{kind}.")]

    # Files.

    async def add_file(self, f: StoredFile, data: bytes) -> None:
        await self._objects.put(f"files/{f.id}", data)
        record = {**msgspec.structs.asdict(f), "created_ns": time.time_ns()}
        key = f"file.{f.id}"
        for _ in range(3):
            held = self._bucket.get(key)
            if held is None or held[0] is None:
                try:
                    await self._bucket.create(key, record)
                    return
                except nats.js.errors.KeyWrongLastSequenceError:
                    await self._bucket.reload(key)
                    continue
            if await self._bucket.write(key, record, held[1]):
                return
            await self._bucket.reload(key)
        raise RuntimeError(f"file {f.id}: written by another gateway at once")

    async def get_file(self, file_id: str, owner: str | None) -> StoredFile | None:
        record = self._bucket.get(f"file.{file_id}")[0]
        return None if record is None or (owner is not None and record["owner"] != owner) else _file(record)

    async def files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[StoredFile], bool]:
        mine = [r for r, _ in self._live("file") if r["owner"] == owner and purpose in (None, r["purpose"])]
        page, more = _paged(mine, after, limit, ascending)
        return [_file(r) for r in page], more

    async def content(self, file_id: str) -> Path | None:
        if self._bucket.get(f"file.{file_id}")[0] is None:
            return None
        return await local_copy(self._objects, f"files/{file_id}", self._cache / file_id)

    async def delete_file(self, file_id: str, owner: str) -> bool:
        key = f"file.{file_id}"
        record, _ = self._bucket.get(key)
        if record is None or record["owner"] != owner:
            return False
        await self._bucket.delete(key)
        await self._remove(file_id)
        return True

    async def _remove(self, file_id: str) -> None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self._objects.delete(f"files/{file_id}")
        await asyncio.to_thread((self._cache / file_id).unlink, True)

    async def expire_files(self, now: float) -> None:
        for record, revision in self._live("file"):
            expired = record["expires_at"] is not None and record["expires_at"] <= now
            if expired and await self._bucket.delete(f"file.{record['id']}", last=revision):  # not if changed
                await self._remove(record["id"])

    async def sweep(self) -> None:
        try:
            listed = await self._objects.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # an empty store
            return
        known = {r["id"] for r, _ in self._live("file")}
        for o in listed:
            if o.name.startswith("files/") and o.name.removeprefix("files/") not in known:
                await self._remove(o.name.removeprefix("files/"))

    # Batches.

    async def add_batch(self, b: Batch) -> None:
        record = {
            "batch": msgspec.to_builtins(b),
            "holder": None,
            "lease_until": None,
            "created_ns": time.time_ns(),
        }
        await self._bucket.create(f"batch.{b.id}", record)

    async def get_batch(self, batch_id: str, owner: str | None) -> Batch | None:
        record = self._bucket.get(f"batch.{batch_id}")[0]
        if record is None or (owner is not None and record["batch"]["owner"] != owner):
            return None
        return _batch(record)

    async def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        mine = [{**r, "id": r["batch"]["id"]} for r, _ in self._live("batch") if r["batch"]["owner"] == owner]
        page, more = _paged(mine, after, limit, ascending=False)
        return [_batch(r) for r in page], more

    async def _changed(self, batch_id: str, holder: str | None, change: Any) -> dict[str, Any] | None:
        """`change(record)` written if `holder` holds the batch (None: whoever does), read again
        where another gateway's write came first; the record written, or None."""
        key = f"batch.{batch_id}"
        for _ in range(5):
            record, revision = self._bucket.get(key)
            if record is None or (holder is not None and record["holder"] != holder):
                return None
            new = change(record)
            if new is None:
                return None
            if await self._bucket.write(key, new, revision):
                return new
            await self._bucket.reload(key)
        return None

    async def change(
        self, batch_id: str, holder: str | None, only_if: tuple[str, ...] | None = None, **values: Any
    ) -> Batch | None:
        def changed(record: dict[str, Any]) -> dict[str, Any] | None:
            if only_if is not None and record["batch"]["status"] not in only_if:
                return None
            return {**record, "batch": {**record["batch"], **values}}

        new = await self._changed(batch_id, holder, changed)
        return None if new is None else _batch(new)

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[Batch]:
        free = sorted(
            (
                (r, rev)
                for r, rev in self._live("batch")
                if r["batch"]["status"] in RUNNABLE and (r["lease_until"] is None or r["lease_until"] < now)
            ),
            key=lambda x: x[0]["created_ns"],
        )
        claimed: list[Batch] = []
        for record, revision in free[:limit]:
            mine = {**record, "holder": holder, "lease_until": now + lease_s}
            if await self._bucket.write(f"batch.{record['batch']['id']}", mine, revision):
                claimed.append(_batch(mine))
        return claimed

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        held = set()
        for batch_id in ids:
            if await self._changed(batch_id, holder, lambda r: {**r, "lease_until": until}) is not None:
                held.add(batch_id)
        return held

    async def release(self, holder: str, ids: list[str]) -> None:
        for batch_id in ids:
            await self._changed(batch_id, holder, lambda r: {**r, "holder": None, "lease_until": None})

    # Outcomes.

    async def add_result(self, batch_id: str, holder: str, result: LineResult) -> Batch | None:
        if (await self.get_batch(batch_id, None)) is None:
            return None
        await self._objects.put(f"results/{batch_id}/{result.index}", result.line)
        try:
            await self._results.create(f"{batch_id}.{result.index}", b"1" if result.ok else b"0")
        except nats.js.errors.KeyWrongLastSequenceError:
            return None  # recorded already

        def counted(record: dict[str, Any]) -> dict[str, Any]:
            b = record["batch"]
            key = "completed" if result.ok else "failed"
            return {**record, "batch": {**b, key: b[key] + 1}}

        new = await self._changed(batch_id, holder, counted)
        return None if new is None else _batch(new)

    async def _result_keys(self, batch_id: str) -> dict[int, bool]:
        watcher = await self._results.watch(f"{batch_id}.>")
        try:
            found: dict[int, bool] = {}
            while (entry := await watcher.updates(timeout=30)) is not None:
                if entry.value and entry.operation not in DELETE_OPS:
                    found[int(entry.key.rsplit(".", 1)[1])] = entry.value == b"1"
            return found
        finally:
            await watcher.stop()

    async def results(self, batch_id: str) -> list[LineResult]:
        out = []
        for index, ok in sorted((await self._result_keys(batch_id)).items()):
            got = await self._objects.get(f"results/{batch_id}/{index}")
            out.append(LineResult(index, ok, got.data or b""))
        return out

    async def drop_results(self, batch_id: str) -> None:
        for index in await self._result_keys(batch_id):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._objects.delete(f"results/{batch_id}/{index}")
            await self._results.purge(f"{batch_id}.{index}")


def _paged(
    records: list[dict[str, Any]], after: str | None, limit: int, ascending: bool
) -> tuple[list[Any], bool]:
    mine = sorted(records, key=lambda r: r["created_ns"], reverse=not ascending)
    if after is not None:
        at = next((k for k, r in enumerate(mine) if r["id"] == after), None)
        if at is None:
            raise KeyError(after)
        mine = mine[at + 1 :]
    return mine[:limit], len(mine) > limit


def _file(record: dict[str, Any]) -> StoredFile:
    return StoredFile(**{k: record[k] for k in StoredFile.__struct_fields__})


def _batch(record: dict[str, Any]) -> Batch:
    return msgspec.convert(record["batch"], Batch)
