"""The OmniConnector API (from the connector RFC): put / get / cleanup / health.

A producer `put`s a payload for one edge and one request and gets back small metadata (a
ConnectorHandle) that travels on the control plane; the consumer `get`s the payload with that
handle. Payloads below the connector's inline threshold ride inside the handle itself, so
small hops cost one NATS message and nothing else.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, Final

import msgspec

from omni_pipeline import wire
from omni_pipeline.settings import ConnectorSpec

_SAFE_ID: Final = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


RECLAIM_GRACE_S: Final = 30.0
"""How long past the longest a request may live (its pipeline's requestTimeoutS) a payload that
nobody read is reclaimed by its writer."""


class ConnectorError(RuntimeError):
    """A payload could not be stored or fetched; it fails the request that owns it."""


class PayloadGone(ConnectorError):
    """The payload a handle names no longer exists. Usually the echo of another failure: its
    producer failed and freed what it had written, and that producer's own error is on its way."""


class ConnectorHandle(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a payload is: inline bytes, or a key in the connector's backend."""

    connector: str
    nbytes: int
    inline: bytes | None = None
    key: str | None = None


def check_request_id(request_id: str) -> str:
    """Request ids end up in segment names and store keys, so only a safe alphabet is allowed."""
    if not _SAFE_ID.match(request_id):
        raise ConnectorError(f"request id {request_id!r} must match {_SAFE_ID.pattern}")
    return request_id


class OmniConnector(ABC):
    """One data-plane backend, shared by every edge of a process that names it."""

    def __init__(self, name: str, spec: ConnectorSpec) -> None:
        self.name = name
        self.kind = spec.kind.value
        self.inline_threshold = spec.inline_threshold_bytes

    def put(
        self, from_stage: str, to_stage: str, request_id: str, data: Any, *, seq: int = 0
    ) -> tuple[bool, int, ConnectorHandle]:
        """Store `data` for the edge; returns (ok, serialized size, handle for the consumer)."""
        check_request_id(request_id)
        frame = wire.encode_frame(data)
        # An empty payload (a stream's end marker, which a consumer may never read) is inline
        # whatever the threshold: held out of band, nothing would ever free it.
        if frame.size < self.inline_threshold or (isinstance(data, dict) and not data):
            return True, frame.size, ConnectorHandle(self.name, frame.size, inline=bytes(frame.to_bytes()))
        try:
            key = self._put_frame(from_stage, to_stage, request_id, seq, frame)
        except Exception as exc:
            raise self._failed("put", exc) from exc
        return True, frame.size, ConnectorHandle(self.name, frame.size, key=key)

    def get(
        self, from_stage: str, to_stage: str, request_id: str, handle: ConnectorHandle
    ) -> tuple[Any, int]:
        """Fetch the payload a handle names; the backend copy is released once read.

        Every failure is a ConnectorError (PayloadGone if the payload no longer exists) whose
        message names this connector, its kind and what the backend said."""
        try:
            if handle.inline is not None:
                return wire.decode(handle.inline), handle.nbytes
            if handle.key is None:
                raise ConnectorError("handle names neither inline data nor a key")
            check_request_id(request_id)
            return self._get_frame(request_id, handle), handle.nbytes
        except Exception as exc:
            raise self._failed("get", exc) from exc

    def _failed(self, op: str, exc: Exception) -> ConnectorError:
        """`exc`, whatever the backend raised, as a ConnectorError naming this connector."""
        kind = PayloadGone if isinstance(exc, PayloadGone) else ConnectorError
        return kind(f"connector '{self.name}' ({self.kind}): {op} failed: {exc}")

    @abstractmethod
    def _put_frame(
        self, from_stage: str, to_stage: str, request_id: str, seq: int, frame: wire.EncodedFrame
    ) -> str:
        """Store a frame too large to inline; return its key."""

    @abstractmethod
    def _get_frame(self, request_id: str, handle: ConnectorHandle) -> Any:
        """Fetch, decode and release the frame under `handle.key`."""

    @abstractmethod
    def cleanup(self, request_id: str) -> int:
        """Free whatever `request_id` still holds in this backend, whoever wrote it; returns
        how many objects."""

    def free_written(self, request_id: str) -> int:
        """Free what this process wrote for `request_id` and nobody read: a replica's request
        ended short. Every replica hears an abort, and each that wrote for the request frees
        its own; the gateway's `cleanup` is the backstop for a writer that died. Here the same
        as `cleanup`; a backend whose `cleanup` searches a store shared by every replica frees
        only what this process knows it wrote."""
        return self.cleanup(request_id)

    def discard(self, request_id: str, handle: ConnectorHandle) -> None:
        """Free a payload this process was handed for `request_id` and will not read (the
        request has ended here). Here by `cleanup`; a backend may free the one payload."""
        self.cleanup(request_id)

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Backend state for /health and /metrics: at least {"ok": bool}."""

    def reclaim_unread(self, older_than_s: float) -> int:
        """Free what this process wrote that nobody read for `older_than_s` (longer than any
        request lives): the message that named it was lost, so no reader will come for it. A
        backstop to `cleanup`; 0 where there is nothing to reclaim."""
        return 0

    def live_objects(self) -> int:
        """Objects this backend holds right now (for the leak gauges)."""
        return 0

    def pooled_bytes(self) -> int:
        """Memory this process keeps for reuse by this backend (the shm pool)."""
        return 0

    def close(self) -> None:
        """Release process-level resources (not per-request ones)."""


class InlineConnector(OmniConnector):
    """Every payload rides in the control message; for small tensors and tests."""

    def __init__(self, name: str, spec: ConnectorSpec) -> None:
        super().__init__(name, spec)
        self.inline_threshold = 1 << 62

    def _put_frame(
        self, from_stage: str, to_stage: str, request_id: str, seq: int, frame: wire.EncodedFrame
    ) -> str:
        raise AssertionError("inline connector never stores out of band")

    def _get_frame(self, request_id: str, handle: ConnectorHandle) -> Any:
        raise ConnectorError("inline connector got a handle with a key")

    def cleanup(self, request_id: str) -> int:
        return 0

    def health(self) -> dict[str, Any]:
        return {"ok": True}
