"""/v1/files and /v1/batches as OpenAI's Files and Batch APIs: upload a JSONL file of requests,
make a batch of it, follow it, cancel it, read its output and error files. Files and batches
belong to the API key that made them (everyone's when keys are off)."""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from omni_gateway.batches.records import COMPLETION_WINDOW_S, Batch, StoredFile
from omni_gateway.batches.runner import BatchRunner
from omni_gateway.errors import BadRequest, NotFound, NotReady, PayloadTooLarge, Unavailable
from omni_gateway.guards import owner_of
from omni_gateway.protocol.batches import BatchCreateRequest, FileUploadFields
from omni_gateway.protocol.common import json_object, parse
from omni_gateway.protocol.videos import ListOrder

router = APIRouter()

RUNNING: Final = ("validating", "in_progress")
"""What a cancel stops; any other status has ended, or is ending."""


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner | None = request.app.state.batches
    if runner is None:
        raise Unavailable(
            "batches cannot be kept here: the gateway could not open its batch store (with store "
            "jetstream: the pipeline's NATS server has JetStream off, and the chart's nats.jetstream "
            "turns it on; with sqlite: spec.gateway.batches.stateDir is not writable)"
        )
    return runner


def _listed(items: list[Any], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [x.resource() for x in items],
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
        "has_more": more,
    }


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    runner = _runner(request)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("send the file as a multipart form (file, purpose)")
    limit = runner.spec.max_file_bytes
    async with request.form(max_files=1, max_part_size=limit) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadRequest("file: a file is required", param="file")
        fields: dict[str, Any] = {
            k: v for k, v in form.items() if k != "file" and not k.startswith("expires_after")
        }
        if "expires_after[anchor]" in form or "expires_after[seconds]" in form:
            anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            fields["expires_after"] = {"anchor": anchor, "seconds": seconds}
        asked: FileUploadFields = parse(FileUploadFields, fields)
        data = await upload.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"file: over the limit of {limit} bytes", param="file")
    now = int(time.time())
    f = StoredFile(
        id=f"file-{secrets.token_hex(12)}",
        owner=owner_of(request),
        purpose=asked.purpose,
        filename=upload.filename or "upload.jsonl",
        bytes=len(data),
        created_at=now,
        expires_at=now + asked.expires_after.seconds if asked.expires_after else None,
    )
    await runner.store.add_file(f, data)
    return f.resource()


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(default=10_000, ge=1, le=10_000),
    order: ListOrder = "desc",
) -> dict[str, Any]:
    try:
        page, more = await _runner(request).store.files(
            owner_of(request), purpose, after, limit, order == "asc"
        )
    except KeyError:
        raise BadRequest(f"after: file '{after}' does not exist", param="after") from None
    return _listed(page, more)


async def _file(request: Request, file_id: str) -> StoredFile:
    f = await _runner(request).store.get_file(file_id, owner_of(request))
    if f is None:
        raise NotFound(f"file '{file_id}' does not exist", param="file_id")
    return f


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return (await _file(request, file_id)).resource()


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> FileResponse:
    f = await _file(request, file_id)
    path = await _runner(request).store.content(f.id)
    if path is None:
        raise NotFound(f"file '{file_id}' has no content (it is gone)", param="file_id")
    return FileResponse(path, media_type="application/octet-stream", filename=f.filename)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    if not await _runner(request).store.delete_file(file_id, owner_of(request)):
        raise NotFound(f"file '{file_id}' does not exist", param="file_id")
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    runner = _runner(request)
    asked: BatchCreateRequest = parse(BatchCreateRequest, await json_object(request))
    source = await _file(request, asked.input_file_id)
    if source.purpose != "batch":
        msg = f"input_file_id: file '{source.id}' was uploaded for {source.purpose}, not batch"
        raise BadRequest(msg, param="input_file_id")
    now = int(time.time())
    batch = Batch(
        id=f"batch_{secrets.token_hex(12)}",
        owner=owner_of(request),
        endpoint=asked.endpoint,
        input_file_id=source.id,
        completion_window=asked.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + COMPLETION_WINDOW_S[asked.completion_window],
        metadata=asked.metadata,
        output_expires_after_s=asked.output_expires_after.seconds if asked.output_expires_after else None,
    )
    await runner.store.add_batch(batch)
    runner.wake()
    return batch.resource()


@router.get("/v1/batches")
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)
) -> dict[str, Any]:
    try:
        page, more = await _runner(request).store.batches(owner_of(request), after, limit)
    except KeyError:
        raise BadRequest(f"after: batch '{after}' does not exist", param="after") from None
    return _listed(page, more)


async def _batch(request: Request, batch_id: str) -> Batch:
    batch = await _runner(request).store.get_batch(batch_id, owner_of(request))
    if batch is None:
        raise NotFound(f"batch '{batch_id}' does not exist", param="batch_id")
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return (await _batch(request, batch_id)).resource()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    """What has not started will not; what finished is kept (the output file has it). The
    batch is `cancelling` until its gateway has written its files, then `cancelled`."""
    runner = _runner(request)
    batch = await _batch(request, batch_id)
    cancelled = await runner.store.change(
        batch.id, None, RUNNING, status="cancelling", cancelling_at=int(time.time())
    )
    if cancelled is None:  # ended, or ending
        current = await _batch(request, batch_id)
        raise NotReady(f"batch '{batch_id}' is {current.status}: only a running batch can be cancelled")
    runner.cancel(batch.id)
    runner.wake()
    return cancelled.resource()
