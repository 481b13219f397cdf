"""Connector calls off the event loop: one I/O thread per process, for the stage worker and the
gateway alike.

A put copies a payload into shared memory or sends it to Mooncake; a get may wait on Mooncake's
network; a cleanup or a count may wait on a backend that is down. None of it may hold up a loop
that beats, admits, aborts and answers HTTP.

A payload small enough to ride inline in its handle touches no backend: it is put and read on
the loop, saving the hop to the thread on every small message. The other calls run one at a
time, in the order made, as they ran on the loop before: the Mooncake
client does not take concurrent calls well through a master restart (calls made side by side
hung for a minute after one; one at a time they fail or succeed at once). Health checks, which
must answer while a call hangs, are not made here.

Ownership: a caller cancelled in the middle of a put or a get waits for that call to finish
before its cancellation goes on, so the cleanup its request's end runs comes after the write it
frees (a payload written after its request's cleanup would have no owner). Cleanups go on the
same thread, queued behind the calls already made; `close` waits for what is queued, then
closes the connectors. A backend that no longer answers holds each call for its own timeout
(Mooncake: `rpcTimeoutMs`, 5 s), so `close` waits `CLOSE_WAIT_S` at most; then it leaves the
calls running and the connectors open (a thread is inside one), and the process exits without
them: the backends' own expiry is the last owner of what they held.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from typing import Any, Final, TypeVar

from omni_pipeline import wire
from omni_pipeline.connectors.base import ConnectorHandle, OmniConnector

log = logging.getLogger("omni.connectors")

IO_THREADS: Final = 1
"""Connector calls one process runs at once (see above); the others wait their turn, and how many
wait is bounded anyway: each running request awaits its own."""

CLOSE_WAIT_S: Final = 10.0
"""How long `close` waits for the connector calls already made."""

T = TypeVar("T")


class OffLoop:
    """One process's connectors, called from its event loop and run on threads."""

    def __init__(self, owner: str, connectors: dict[str, OmniConnector]) -> None:
        self.owner = owner
        """Who this is, in log lines: `stage talker`, `gateway`."""
        self.connectors = connectors
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="connector-io")
        self._pending: dict[Callable[..., object], asyncio.Future[object]] = {}
        """`within`'s calls still running, one per function."""
        self._last: Future[None] | None = None
        """Once closing: the pool's last call, done when every call before it is."""

    async def put(
        self, conn: OmniConnector, from_stage: str, to_stage: str, request_id: str, data: Any, seq: int = 0
    ) -> tuple[bool, int, ConnectorHandle]:
        if wire.payload_nbytes(data) < conn.inline_threshold:  # it rides inline: no backend, a small copy
            return conn.put(from_stage, to_stage, request_id, data, seq=seq)
        return await self.call(lambda: conn.put(from_stage, to_stage, request_id, data, seq=seq))

    async def get(
        self, conn: OmniConnector, from_stage: str, to_stage: str, request_id: str, handle: ConnectorHandle
    ) -> tuple[Any, int]:
        if handle.inline is not None:  # in the handle itself: no backend, a small decode
            return conn.get(from_stage, to_stage, request_id, handle)
        return await self.call(conn.get, from_stage, to_stage, request_id, handle)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Any call of the data plane that may wait on a connector's backend."""
        job = self._pool.submit(fn, *args)
        done = asyncio.wrap_future(job)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # Not started yet: dropped, it will write nothing. Running: let it end before the
            # caller does, so the request's cleanup cannot run before a write of it. What it
            # raised no one reads now (the request is gone).
            if job.cancel():
                raise
            await asyncio.wait([done])
            if not done.cancelled():
                done.exception()
            raise
        finally:
            # The futures keep what `fn` raised, and its traceback keeps this frame and every
            # caller's: a cycle, that would pin what the callers' locals hold (zero-copy views
            # on another process's shared memory) until the cyclic collector ran. Let go here.
            del job, done

    async def within(self, seconds: float, fn: Callable[..., object], *args: Any) -> bool:
        """Run `fn` off the loop and wait for it at most `seconds`; False if it is still running
        then (it goes on, and whatever it records lands when it ends). For what may be stale
        rather than late: the counts a /metrics scrape reports, when a backend is slow. While a
        call of `fn` is still pending, no other is queued: it is waited for again."""
        fut = self._pending.get(fn)
        if fut is None or fut.done():
            fut = self._pending[fn] = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if no one waits
        done, _ = await asyncio.wait([fut], timeout=seconds)
        if done:
            fut.result()
        return bool(done)

    def cleanup(self, request_id: str) -> None:
        """Free whatever every connector holds for the request, whoever wrote it (the gateway's
        backstop), in the background (after any write of it still in progress)."""
        self._free(
            request_id, {n: functools.partial(c.cleanup, request_id) for n, c in self.connectors.items()}
        )

    def free_written(self, request_id: str) -> None:
        """Free what this process wrote for the request in every connector (a replica's
        request ended short), in the background (after any write of it still in progress)."""
        self._free(
            request_id, {n: functools.partial(c.free_written, request_id) for n, c in self.connectors.items()}
        )

    def discard(self, request_id: str, handle: ConnectorHandle) -> None:
        """Free a payload handed to this process for a request that has ended here."""
        conn = self.connectors.get(handle.connector)
        if conn is not None and handle.inline is None:
            self._free(request_id, {handle.connector: functools.partial(conn.discard, request_id, handle)})

    def _free(self, request_id: str, frees: dict[str, Callable[[], object]]) -> None:
        """Run `frees` (each a connector's, by its name) on the I/O thread, after what is queued."""
        try:
            self._pool.submit(self._free_now, request_id, frees)
        except RuntimeError:  # closed: a request that ended as the process stopped
            log.warning("%s: request %s ended after its connectors closed", self.owner, request_id)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Wait up to `wait_s` for the calls still queued (cleanups), then close the connectors.
        False if calls were still running then: the connectors are left open, and a later
        `close` waits for those calls again."""
        if self._last is None:  # one thread, in order: this no-op runs after every call made
            self._last = self._pool.submit(lambda: None)
            self._pool.shutdown(wait=False)
        if not wait_for_futures([self._last], timeout=wait_s).done:
            log.warning(
                "%s: connector calls still running after %g s (a backend not answering); "
                "leaving them and the connectors open",
                self.owner,
                wait_s,
            )
            return False
        for c in self.connectors.values():
            c.close()
        return True

    def _free_now(self, request_id: str, frees: dict[str, Callable[[], object]]) -> None:
        for name, free in frees.items():
            try:
                free()
            except Exception as exc:  # the backend's own expiry is the last owner then
                log.warning("%s: freeing %s in connector %s failed: %s", self.owner, request_id, name, exc)
