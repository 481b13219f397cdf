"""What the Batch API keeps: a file and a batch as stored, and how OpenAI's API shows each.

A batch's lines run one by one (a few at once) and each one's outcome is kept as it ends
(`LineResult`), so a batch taken up again (a restart, another gateway after this one died)
runs only the lines with none; its output and error files are written from those once every
line has one.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

COMPLETION_WINDOW_S: Final = {"24h": 86400}
RUNNABLE: Final = ("validating", "in_progress", "finalizing", "cancelling")
"""A batch in one of these has work left, done by the gateway that holds its lease."""
ENDED: Final = ("failed", "completed", "expired", "cancelled")


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """An object as OpenAI's schema has it: a field with no value left out, not null."""
    return {k: v for k, v in fields.items() if v is not None}


class StoredFile(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def resource(self) -> dict[str, Any]:
        return _present(
            {
                "id": self.id,
                "object": "file",
                "bytes": self.bytes,
                "created_at": self.created_at,
                "expires_at": self.expires_at,
                "filename": self.filename,
                "purpose": self.purpose,
                "status": "processed",
            }
        )


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """One batch as it is stored; `resource()` is OpenAI's `Batch` object."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    model: str | None = None
    metadata: dict[str, str] | None = None
    output_expires_after_s: int | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    usage: dict[str, Any] | None = None
    """The answered lines' tokens, summed once the batch ends (lines.summed_usage)."""

    def resource(self) -> dict[str, Any]:
        return _present(
            {
                "id": self.id,
                "object": "batch",
                "endpoint": self.endpoint,
                "model": self.model,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id,
                "completion_window": self.completion_window,
                "status": self.status,
                "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id,
                "created_at": self.created_at,
                "in_progress_at": self.in_progress_at,
                "expires_at": self.expires_at,
                "finalizing_at": self.finalizing_at,
                "completed_at": self.completed_at,
                "failed_at": self.failed_at,
                "expired_at": self.expired_at,
                "cancelling_at": self.cancelling_at,
                "cancelled_at": self.cancelled_at,
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata,
                "usage": self.usage,
            }
        )


class LineResult(msgspec.Struct, frozen=True):
    """One input line's outcome: its line of the output file (`ok`) or of the error file."""

    index: int
    ok: bool
    line: bytes
