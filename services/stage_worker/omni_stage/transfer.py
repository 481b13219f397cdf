"""A replica's connector I/O, off its event loop: puts, gets and cleanups on a small thread pool.

A put copies a payload into shared memory or sends it to Mooncake; a get may wait on Mooncake's
network; a cleanup may wait on a backend that is down. None of it may hold up the loop that
beats, admits and aborts. Each call is timed and traced as before.

Ownership: a request's task that is cancelled in the middle of a put or a get waits for that
call to finish before it ends, so the cleanup its end runs comes after the write it freed
(a payload written after its request's cleanup would have no owner). Cleanups go on the same
pool; `close` waits for what is queued there, then closes the connectors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from omni_pipeline import tracing
from omni_pipeline.connectors import ConnectorHandle, OmniConnector
from omni_stage.metrics import StageMetrics

log = logging.getLogger("omni.stage")

IO_THREADS: Final = 4
"""Connector calls one replica runs at once; more wait their turn (the number in flight is
bounded anyway: each running request awaits its own)."""

T = TypeVar("T")


class Transfers:
    """One replica's connector calls, timed, traced and run off the loop."""

    def __init__(self, stage: str, connectors: dict[str, OmniConnector], metrics: StageMetrics) -> None:
        self.stage = stage
        self.connectors = connectors
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix=f"connector-{stage}")

    async def put(
        self, conn: OmniConnector, consumer: str, request_id: str, data: Any, seq: int
    ) -> tuple[int, ConnectorHandle]:
        """Write a payload for `consumer`; returns its size and the handle that reads it."""
        with tracing.span("omni.connector.put", attributes=_edge(conn, consumer)) as span:
            t = time.perf_counter()
            _, nbytes, handle = await self._run(conn.put, self.stage, consumer, request_id, data, seq=seq)
            self.metrics.connector(conn.name, "put", consumer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return nbytes, handle

    async def get(self, conn: OmniConnector, producer: str, request_id: str, handle: ConnectorHandle) -> Any:
        """Read (and so free) a payload `producer` wrote for this stage."""
        with tracing.span("omni.connector.get", attributes=_edge(conn, producer)) as span:
            t = time.perf_counter()
            payload, nbytes = await self._run(conn.get, producer, self.stage, request_id, handle)
            self.metrics.connector(conn.name, "get", producer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return payload

    def cleanup(self, request_id: str) -> None:
        """Free whatever every connector holds for the request, in the background (queued behind
        the calls already running, so after any write of it still in progress)."""
        self._pool.submit(self._cleanup_now, request_id)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Any other call that may wait on a connector's backend (a health check, a count)."""
        return await self._run(fn, *args)

    def close(self, connectors: Iterable[OmniConnector]) -> None:
        """Wait for the cleanups still queued, then close the connectors."""
        self._pool.shutdown(wait=True)
        for c in connectors:
            c.close()

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # Cancelled (aborted): the call goes on in its thread; let it end before we do, so
            # the request's cleanup cannot run before a write of it.
            await asyncio.wait([fut])
            raise

    def _cleanup_now(self, request_id: str) -> None:
        for c in self.connectors.values():
            try:
                c.cleanup(request_id)
            except Exception:
                log.exception(
                    "stage %s: cleanup of %s in connector %s failed", self.stage, request_id, c.name
                )


def _edge(conn: OmniConnector, peer: str) -> dict[str, str]:
    return {"omni.connector": conn.name, "omni.connector.kind": conn.kind, "omni.peer": peer}
