"""A batch's ending: its output and error files written from its lines' outcomes, its status set
(completed, cancelled, expired, or failed with why), its outcomes then forgotten.

Every way a batch ends passes here, and each may be done twice: a gateway that dies while ending
a batch leaves it `finalizing` or `cancelling`, and the next to take it up ends it again. The
files' ids are the same however often they are written (`output_file_id`), and a status moves
only from the one it was read in, so a cancel that came meanwhile is not undone by a completion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

from omni_gateway.batches.calls import LineCalls
from omni_gateway.batches.lines import InputLine, not_run, read_input, summed_usage
from omni_gateway.batches.records import Batch, StoredFile
from omni_gateway.batches.store import BatchStore
from omni_gateway.metrics import GatewayMetrics
from omni_pipeline.settings import BatchesSpec

log = logging.getLogger("omni.gateway.batches")

NEVER_RAN: Final = {
    "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
    "expired": ("batch_expired", "the batch's completion window ended before this request ran"),
}
"""The error file's code and message for a line a batch ending so never ran."""
STAMPS: Final = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}


def output_file_id(batch_id: str, kind: str) -> str:
    """A batch's output (`output`) or error (`error`) file's id: the same however often it is
    written (a gateway that died while finalizing leaves it to the next to write again)."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


async def stored_input(
    store: BatchStore, batch: Batch, max_lines: int
) -> tuple[list[InputLine], list[dict[str, Any]]] | None:
    """The batch's input file read (lines.read_input); None where the file is gone."""
    path = await store.content(batch.input_file_id)
    if path is None:
        return None
    return read_input(await asyncio.to_thread(path.read_bytes), batch.endpoint, max_lines)


class BatchEnding:
    """Ends the batches of one holder (a gateway's runner), as that holder."""

    def __init__(
        self, store: BatchStore, holder: str, calls: LineCalls, spec: BatchesSpec, metrics: GatewayMetrics
    ) -> None:
        self.store, self.holder, self.calls, self.spec, self.metrics = store, holder, calls, spec, metrics

    async def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """End the batch as failed, for these reasons (its input was bad, or running it raised)."""
        await self.store.change(
            batch_id, self.holder, status="failed", failed_at=int(time.time()), errors=errors
        )
        self.metrics.batches.labels(status="failed").inc()

    async def settle(self, batch_id: str) -> None:
        """End the batch as it stands once its lines have stopped: cancelled if a cancel came,
        expired if its window ended with lines left, completed otherwise."""
        current = await self.store.get_batch(batch_id, None)
        if current is None:
            return
        if current.status == "cancelling":
            await self.end(current, "cancelled")
        elif time.time() >= current.expires_at and current.completed + current.failed < current.total:
            await self.end(current, "expired")
        else:
            await self.end(current, "completed")

    async def end_if_cancelled(self, batch_id: str) -> None:
        current = await self.store.get_batch(batch_id, None)
        if current is not None and current.status == "cancelling":
            await self.end(current, "cancelled")

    async def end(self, batch: Batch, status: str) -> None:
        """Write the output and error files from the lines' outcomes and end the batch as `status`
        (completed passes through `finalizing`; cancelled and expired end at once)."""
        now = int(time.time())
        if status == "completed" and batch.status != "finalizing":
            changed = await self.store.change(
                batch.id, self.holder, ("in_progress",), status="finalizing", finalizing_at=now
            )
            if changed is None:  # cancelled meanwhile (or no longer ours)
                await self.end_if_cancelled(batch.id)
                return
        results = await self.store.results(batch.id)
        ran = {r.index for r in results}
        outputs = [r.line for r in results if r.ok]
        errors = [r.line for r in results if not r.ok]
        if status != "completed":
            code, why = NEVER_RAN[status]
            read = await stored_input(self.store, batch, self.spec.max_lines)
            left = [x for x in (read[0] if read else []) if x.index not in ran]
            errors += [not_run(x.custom_id, code, why) for x in left]
            await self.calls.abandon(batch, left)
        retention = batch.output_expires_after_s or self.spec.output_retention_s
        ids = {
            kind: await self._stored(batch, kind, body, now, retention)
            for kind, body in (("output", outputs), ("error", errors))
        }
        await self.store.change(
            batch.id,
            self.holder,
            status=status,
            output_file_id=ids["output"],
            error_file_id=ids["error"],
            usage=summed_usage(outputs),
            **{STAMPS[status]: int(time.time())},
        )
        await self.store.drop_results(batch.id)
        self.metrics.batches.labels(status=status).inc()
        log.info("batch %s %s: %d lines out, %d in errors", batch.id, status, len(outputs), len(errors))

    async def _stored(
        self, batch: Batch, kind: str, lines: list[bytes], now: int, retention: float
    ) -> str | None:
        """The batch's `kind` file (output or error) of these lines, stored; its id (None: no
        lines, no file)."""
        if not lines:
            return None
        f = StoredFile(
            id=output_file_id(batch.id, kind),
            owner=batch.owner,
            purpose="batch_output",
            filename=f"{batch.id}_{kind}.jsonl",
            bytes=sum(len(x) + 1 for x in lines),
            created_at=now,
            expires_at=int(now + retention),
        )
        await self.store.add_file(f, b"".join(x + b"\n" for x in lines))
        return f.id
