"""HTTP routes: a typed request in, a service call, a response or a stream out."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omni_gateway.chat import ChatResult, completion_body, now, sse_chunks
from omni_gateway.errors import BadRequest, ModelNotFound
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.protocol import ChatCompletionRequest, sampling_params, stage_inputs
from omni_gateway.service import Event, PipelineClient

router = APIRouter()


def _service(request: Request) -> PipelineClient:
    return request.app.state.service  # type: ignore[no-any-return]


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    svc = _service(request)
    return {
        "object": "list",
        "data": [
            {
                "id": svc.spec.served_model_name,
                "object": "model",
                "created": svc.started_at,
                "owned_by": "omni-pipeline",
                "modalities": sorted(k.value for k in svc.spec.output_kinds()),
            }
        ],
    }


@router.get("/health/live")
async def live() -> dict[str, str]:
    """The process answers (Kubernetes' liveness probe; /health says whether it can serve)."""
    return {"status": "alive"}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    svc = _service(request)
    ok = svc.ready()
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m, svc = _metrics(request), _service(request)
    m.tracked.set(len(svc.inflight))
    m.resources.refresh(svc.nc, svc.connectors.values())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/replicas")
async def replicas(request: Request) -> dict[str, Any]:
    """The live replica table this gateway routes by (for operators)."""
    return {"replicas": _service(request).table.snapshot()}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    svc = _service(request)
    if req.model != svc.spec.served_model_name:
        raise ModelNotFound(f"model '{req.model}' does not exist", param="model")
    limit = svc.spec.gateway.max_tokens
    if (asked := req.max_completion_tokens or req.max_tokens) is not None and asked > limit:
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise BadRequest(f"{param}: {asked} is more than this model's limit of {limit}", param=param)
    missing = req.wanted_outputs() - svc.spec.output_kinds()
    if missing:
        raise BadRequest(
            f"model '{req.model}' cannot output {sorted(m.value for m in missing)}", param="modalities"
        )
    rid = uuid.uuid4().hex
    m = _metrics(request)
    t0 = time.monotonic()
    events = svc.generate(rid, stage_inputs(req), sampling_params(req), req.wanted_outputs())
    m.inflight.inc()
    streaming = False  # once the stream exists, it owns the in-flight count (see _counted)
    try:
        first = await _first(events, request)  # errors before any output keep their HTTP status
        m.first_output.observe(time.monotonic() - t0)
        if req.stream:
            response = StreamingResponse(
                _counted(sse_chunks(req, rid, now(), first, events), m, t0), media_type="text/event-stream"
            )
            streaming = True
            return response
        result = ChatResult()
        result.add(first)
        await _until_disconnect(_collect(events, result), request)
        m.latency.observe(time.monotonic() - t0)
        return JSONResponse(completion_body(req, rid, now(), result))
    except BaseException:
        await events.aclose()
        raise
    finally:
        if not streaming:
            m.inflight.dec()


async def _first(events: AsyncIterator[Event], request: Request) -> Event:
    async def first() -> Event:
        return await anext(events)

    return await _until_disconnect(first(), request)


async def _collect(events: AsyncIterator[Event], result: ChatResult) -> None:
    async for ev in events:
        result.add(ev)


async def _until_disconnect(coro: Any, request: Request) -> Any:
    """Run `coro`; if the client disconnects first, cancel it (which aborts the request)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise asyncio.CancelledError("client disconnected")
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _counted(chunks: AsyncIterator[str], m: GatewayMetrics, t0: float) -> AsyncIterator[str]:
    try:
        async for c in chunks:
            yield c
    finally:
        m.inflight.dec()
        m.latency.observe(time.monotonic() - t0)
