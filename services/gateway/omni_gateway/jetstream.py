"""The JetStream key-value buckets a gateway keeps state in (video jobs, uploaded voices,
batches): opened where they exist, made where they do not yet (the first gateway of a pipeline
makes them); and local copies of what their object stores hold, to serve and read."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats.js.errors


async def key_value(js: Any, bucket: str) -> Any:
    """The bucket, one revision a key kept (every write is a compare-and-set on it)."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, history=1)


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
