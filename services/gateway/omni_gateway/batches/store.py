"""What a batch store does (sqlite_store.py for `omni serve`, jetstream_store.py for Distributed
mode and Kubernetes): it keeps the files, the batches and each line's outcome.

A running batch is leased: its gateway renews the lease while it lives; a batch whose lease has
lapsed (its gateway died) is claimed by the next gateway that looks, and one claim wins. A
line's outcome is recorded once: a second record of the same line (run again after its gateway
died before the lease moved on) is refused, so no line is in the output twice. Files and
batches belong to the API key that made them (`owner`); no key sees another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from omni_gateway.batches.records import Batch, LineResult, StoredFile


class BatchStore(Protocol):
    async def add_file(self, f: StoredFile, data: bytes) -> None:
        """A file, its bytes stored before it is listed (written again whole under the same id)."""

    async def get_file(self, file_id: str, owner: str | None) -> StoredFile | None:
        """The file, if it exists and is `owner`'s (None: anyone's)."""

    async def files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[StoredFile], bool]:
        """Up to `limit` of the owner's files (of `purpose`) in upload order or its reverse, from
        the one after `after` (KeyError: no such file of the owner's); and whether more follow."""

    async def content(self, file_id: str) -> Path | None:
        """A local copy of the file's bytes to read or serve; None if there are none."""

    async def delete_file(self, file_id: str, owner: str) -> bool: ...

    async def expire_files(self, now: float) -> None:
        """Delete the files past their `expires_at`, bytes and all."""

    async def sweep(self) -> None:
        """Remove bytes whose file is gone (a gateway that died between the two)."""

    async def add_batch(self, b: Batch) -> None: ...

    async def get_batch(self, batch_id: str, owner: str | None) -> Batch | None:
        """The batch, if it exists and is `owner`'s (None: anyone's)."""

    async def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The owner's batches, newest first, from the one after `after` (KeyError: none such)."""

    async def change(
        self, batch_id: str, holder: str | None, only_if: tuple[str, ...] | None = None, **values: Any
    ) -> Batch | None:
        """Set a batch's fields if `holder` holds it (None: whoever does) and, with `only_if`,
        its status is one of those (a cancel does not undo an end, nor a start a cancel); the
        batch as it is then, or None."""

    async def claim(self, holder: str, now: float, lease_s: float, limit: int) -> list[Batch]:
        """Lease up to `limit` batches with work left that no live gateway holds (oldest first)."""

    async def renew(self, holder: str, ids: list[str], until: float) -> set[str]:
        """Extend the holder's leases on `ids`; the ids it still holds."""

    async def release(self, holder: str, ids: list[str]) -> None:
        """Give batches back for the next gateway to take at once (a graceful stop)."""

    async def add_result(self, batch_id: str, holder: str, result: LineResult) -> Batch | None:
        """A line's outcome, once, its batch's counts moved with it: the batch then, or None (not
        held by `holder`, or the line already has an outcome)."""

    async def results(self, batch_id: str) -> list[LineResult]:
        """Every outcome recorded for the batch, in line order."""

    async def drop_results(self, batch_id: str) -> None:
        """Forget the outcomes (once its output and error files hold them)."""

    async def close(self) -> None: ...
