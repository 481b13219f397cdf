"""The JetStream key-value buckets a gateway keeps state in (video jobs, uploaded voices):
opened where they exist, made where they do not yet (the first gateway of a pipeline makes them)."""

from __future__ import annotations

from typing import Any

import nats.js.errors


async def key_value(js: Any, bucket: str) -> Any:
    """The bucket, one revision a key kept (every write is a compare-and-set on it)."""
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, history=1)
