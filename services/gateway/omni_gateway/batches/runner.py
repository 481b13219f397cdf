"""The batch runner: takes batches from the store and runs their lines through this gateway's
own endpoints, in the same process (an ASGI call: the same validation, errors and pipeline path
as a client's request), a few at once.

Every `lease_s / 3` (and whenever a batch is made or cancelled) the runner renews the leases of
the batches it runs, stops those it no longer holds, and claims what is runnable and unheld (new
batches, and those of a gateway that died). A batch is validated (its input file read as OpenAI
reads it: a bad line fails it whole), then its lines run, `concurrency` at once over all of this
gateway's batches; each line's outcome is stored as it ends, so a batch taken up again runs only
the lines that have none. Once every line has one, or the batch is cancelled or past its window,
its output and error files are written (lines never run go to the error file, with why) and it
ends. A gateway that stops gives its batches back at once; their lines in flight run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

import nats.errors

from omni_gateway.batches.calls import LineCalls, Unrouted
from omni_gateway.batches.ending import BatchEnding, stored_input
from omni_gateway.batches.jetstream_store import JetStreamBatchStore
from omni_gateway.batches.lines import InputLine, batch_error
from omni_gateway.batches.records import Batch, LineResult
from omni_gateway.batches.sqlite_store import SqliteBatchStore
from omni_gateway.batches.store import BatchStore
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_pipeline.settings import BatchesSpec
from omni_pipeline.spec import Mode

log = logging.getLogger("omni.gateway.batches")


class BatchRunner:
    def __init__(
        self,
        app: Any,
        pipeline: Pipeline,
        store: BatchStore,
        spec: BatchesSpec,
        metrics: GatewayMetrics,
    ) -> None:
        self.store, self.spec, self.metrics = store, spec, metrics
        self.holder = f"{pipeline.gateway_id}-{secrets.token_hex(4)}"
        self.calls = LineCalls(app, pipeline, spec, metrics)
        self.ending = BatchEnding(store, self.holder, self.calls, spec, metrics)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, app: Any, pipeline: Pipeline, name: str) -> BatchRunner | None:
        """The batches of `pipeline` (named `name`), in the store its mode keeps them in (`store:
        auto`: SQLite in SingleNode, JetStream otherwise); None where that store cannot be opened
        (JetStream off, a state directory not writable): then the Batch API alone is refused."""
        spec = pipeline.spec.gateway.batches
        kind = spec.store
        if kind == "auto":
            kind = "sqlite" if pipeline.spec.mode is Mode.SINGLE_NODE else "jetstream"
        root = Path(spec.state_dir) / name
        store: BatchStore
        try:
            if kind == "sqlite":
                store = await asyncio.to_thread(SqliteBatchStore, root)
            else:
                store = await JetStreamBatchStore.open(pipeline.nats, name, root / "cache")
        except (OSError, sqlite3.Error, nats.errors.Error, TimeoutError) as exc:
            log.warning("batches: none can be kept (store %s): %s", kind, exc)
            return None
        log.info("batches: kept in %s", "SQLite under " + str(root) if kind == "sqlite" else "JetStream")
        return cls(app, pipeline, store, spec, app.state.metrics)

    async def start(self) -> None:
        await self.store.sweep()
        self._loop = asyncio.create_task(self._tend(), name="batches")

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop running `batch_id` now, if this gateway runs it (it then ends as cancelled)."""
        task = self._running.get(batch_id)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        """Stop running, and give every batch held back for the next gateway to take at once."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        held = list(self._running)
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        await self.store.release(self.holder, held)
        await self.calls.close()
        await self.store.close()

    async def _tend(self) -> None:
        while True:
            try:
                now = time.time()
                kept = await self.store.renew(self.holder, list(self._running), now + self.spec.lease_s)
                for batch_id in set(self._running) - kept:
                    log.warning("batch %s: its lease was lost; another gateway runs it", batch_id)
                    self._running[batch_id].cancel()
                room = self.spec.concurrency - len(self._running)
                if room > 0:
                    for batch in await self.store.claim(self.holder, now, self.spec.lease_s, room):
                        log.info("batch %s: running it (%s)", batch.id, batch.status)
                        task = asyncio.create_task(self._run(batch), name=f"batch-{batch.id}")
                        self._running[batch.id] = task
                        task.add_done_callback(lambda _, b=batch.id: self._ended(b))
                await self.store.expire_files(now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batches: the store could not be read; trying again")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.spec.lease_s / 3):
                    await self._wake.wait()
            self._wake.clear()

    def _ended(self, batch_id: str) -> None:
        self._running.pop(batch_id, None)
        self._wake.set()  # room for another

    async def _run(self, batch: Batch) -> None:
        self.metrics.batches_running.inc()
        try:
            await self._run_batch(batch)
        except asyncio.CancelledError:
            await asyncio.shield(self.ending.end_if_cancelled(batch.id))
            raise
        except Exception as exc:
            log.exception("batch %s failed", batch.id)
            await self.ending.fail(batch.id, [batch_error("internal_error", f"{type(exc).__name__}: {exc}")])
        finally:
            self.metrics.batches_running.dec()

    async def _run_batch(self, batch: Batch) -> None:
        if batch.status in ("cancelling", "finalizing"):  # taken up from a gateway that died ending it
            await self.ending.end(batch, "cancelled" if batch.status == "cancelling" else "completed")
            return
        lines = await self._input(batch)
        if lines is None:
            return
        if batch.status == "validating":
            model = next((str(x.body["model"]) for x in lines if isinstance(x.body.get("model"), str)), None)
            changed = await self.store.change(
                batch.id,
                self.holder,
                ("validating",),  # not a batch cancelled meanwhile
                status="in_progress",
                in_progress_at=int(time.time()),
                total=len(lines),
                model=model,
            )
            if changed is None:
                await self.ending.end_if_cancelled(batch.id)
                return
            batch = changed
        results = await self.store.results(batch.id)
        done = {r.index for r in results}
        ok = sum(r.ok for r in results)
        if (batch.completed, batch.failed) != (ok, len(results) - ok):  # a holder died between line and count
            recounted = await self.store.change(batch.id, self.holder, completed=ok, failed=len(results) - ok)
            batch = recounted or batch
        pending: set[asyncio.Task[None]] = set()
        waiting = len(lines) - len(done)
        self.metrics.batch_lines_waiting.inc(waiting)
        try:
            for line in lines:
                if line.index in done:
                    continue
                if (unrouted := await self._room(batch)) is None:
                    break
                waiting -= 1
                self.metrics.batch_lines_waiting.dec()
                task = asyncio.create_task(self._run_line(batch, line, unrouted))
                task.add_done_callback(lambda _, u=unrouted: self.calls.free(u))  # ended, started or not
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*pending)
        finally:
            self.metrics.batch_lines_waiting.dec(waiting)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.ending.settle(batch.id)

    async def _room(self, batch: Batch) -> Unrouted | None:
        """Room for the batch's next line (LineCalls.room), the line's to give back (its task's
        end does); None, nothing held, once the batch no longer runs."""
        unrouted = await self.calls.room(batch)
        try:
            current = await self.store.get_batch(batch.id, None)
        except BaseException:  # cancelled (the batch is), or the store failed
            self.calls.free(unrouted)
            raise
        if current is None or current.status != "in_progress" or time.time() >= batch.expires_at:
            self.calls.free(unrouted)
            return None
        return unrouted

    async def _input(self, batch: Batch) -> list[InputLine] | None:
        """The batch's requests; None if its input cannot be read or holds a bad line (then it
        has failed, every bad line named)."""
        read = await stored_input(self.store, batch, self.spec.max_lines)
        if read is None:
            errors = [batch_error("file_not_found", f"input file '{batch.input_file_id}' is gone")]
        else:
            lines, errors = read
            if not errors:
                return lines
        await self.ending.fail(batch.id, errors)
        log.info("batch %s failed validation: %s", batch.id, errors[0]["message"])
        return None

    async def _run_line(self, batch: Batch, line: InputLine, unrouted: Unrouted) -> None:
        with self.metrics.batch_lines_running.track_inprogress():
            result = LineResult(line.index, *await self.calls.answer(batch, line, unrouted))
        self.metrics.batch_lines.labels(outcome="ok" if result.ok else "error").inc()
        await self.store.add_result(batch.id, self.holder, result)
