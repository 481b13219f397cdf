"""/v1/videos as OpenAI's Videos API: create a job, retrieve, list, delete, its content (with
range requests), remix. The synchronous /v1/videos/sync is in omni_gateway.routes."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from omni_gateway.errors import BadRequest, NotFound, NotReady, NotServed, Overloaded
from omni_gateway.guards import owner_of
from omni_gateway.internal import JOB_ID_HEADER, internal_header
from omni_gateway.protocol.common import json_object, parse
from omni_gateway.protocol.videos import (
    ListOrder,
    VideoCreateRequest,
    VideoRemixRequest,
    read_video_request,
)
from omni_gateway.request import BATCH_PRIORITY
from omni_gateway.videos.jobs import VideoJobs, checked
from omni_gateway.videos.media import FILE_NAMES, MEDIA_TYPES
from omni_gateway.videos.store import StoreFull, VideoJob

router = APIRouter()


def _jobs(request: Request) -> VideoJobs:
    jobs: VideoJobs | None = request.app.state.video_jobs
    if jobs is None:
        name = request.app.state.pipeline.spec.served_model_name
        raise NotServed(f"model '{name}' does not make video")
    return jobs


async def _job(request: Request, video_id: str) -> VideoJob:
    job = await _jobs(request).store.get(video_id, owner_of(request))
    if job is None:
        raise NotFound(f"video '{video_id}' does not exist", param="video_id")
    return job


async def _create(request: Request, req: VideoCreateRequest, remixed_from: str | None = None) -> VideoJob:
    jobs = _jobs(request)
    req = req.seeded()
    if batch := BATCH_PRIORITY.get():  # a batch line's job runs behind live users' requests
        req = req.model_copy(update={"priority": req.priority + batch})
    await checked(jobs.pipeline, req, progress=True)  # what it can refuse now: a 400 now
    width, height = req.width_height()
    job = VideoJob(
        id=internal_header(request, JOB_ID_HEADER) or f"video_{secrets.token_hex(12)}",
        owner=owner_of(request),
        status="queued",
        created_at=int(time.time()),
        model=jobs.pipeline.spec.served_model_name,
        prompt=req.prompt,
        size=f"{width}x{height}" if width and height else "",
        seconds=req.seconds or "",
        request=req.model_dump(exclude_none=True),
        remixed_from=remixed_from,
    )
    spec = jobs.spec
    try:
        await jobs.store.add(job, spec.max_queued, spec.max_queued_per_key)
    except StoreFull as full:
        whose = "this API key's" if full.scope == "key" else "this server's"
        raise Overloaded(
            f"{whose} limit of {full.limit} video jobs queued or running is reached; try again later",
            code="too_many_jobs",
        ) from None
    jobs.wake()
    return job


@router.post("/v1/videos")
async def create_video(request: Request) -> dict[str, Any]:
    return (await _create(request, await read_video_request(request))).resource()


@router.get("/v1/videos")
async def list_videos(
    request: Request,
    after: str | None = None,
    limit: int = Query(default=20, ge=1, le=100),
    order: ListOrder = "desc",
) -> dict[str, Any]:
    jobs = _jobs(request)
    try:
        page, more = await jobs.store.page(owner_of(request), after, limit, order == "asc")
    except KeyError:
        raise BadRequest(f"after: video '{after}' does not exist", param="after") from None
    return {
        "object": "list",
        "data": [j.resource() for j in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": more,
    }


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str) -> dict[str, Any]:
    return (await _job(request, video_id)).resource()


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str) -> dict[str, Any]:
    """The job goes, running or not (its run ends), and its files with it."""
    jobs = _jobs(request)
    if not await jobs.store.delete(video_id, owner_of(request)):
        raise NotFound(f"video '{video_id}' does not exist", param="video_id")
    jobs.cancel(video_id)
    jobs.wake()  # another gateway running it finds it gone when it next renews
    await jobs.store.remove_files([video_id])
    return {"object": "video.deleted", "deleted": True, "id": video_id}


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, variant: str = "video") -> FileResponse:
    """The file, with range requests (Starlette's FileResponse answers `Range`)."""
    if variant not in MEDIA_TYPES:
        raise BadRequest(f"variant: '{variant}' is not one of {', '.join(MEDIA_TYPES)}", param="variant")
    job = await _job(request, video_id)
    if job.status != "completed":
        raise NotReady(f"video '{video_id}' has no content: it is {job.status}")
    path = await _jobs(request).store.file(video_id, FILE_NAMES[variant])
    if path is None:
        raise NotFound(f"video '{video_id}' has no {variant} (its files are gone)", param="video_id")
    return FileResponse(path, media_type=MEDIA_TYPES[variant], filename=f"{video_id}.{path.suffix[1:]}")


@router.post("/v1/videos/{video_id}/remix")
async def remix_video(request: Request, video_id: str) -> dict[str, Any]:
    """A new job: the finished source's request (its size, length, steps and seed: the same
    starting noise) with a new prompt."""
    remix: VideoRemixRequest = parse(VideoRemixRequest, await json_object(request))
    source = await _job(request, video_id)
    if source.status != "completed":
        raise NotReady(f"video '{video_id}' is {source.status}; only a completed video can be remixed")
    req = parse(VideoCreateRequest, {**source.request, "prompt": remix.prompt})
    return (await _create(request, req, remixed_from=video_id)).resource()
