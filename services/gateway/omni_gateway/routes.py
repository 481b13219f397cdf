"""HTTP routes: a typed request in, a service call, a response or a stream out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.exposition import choose_encoder
from starlette.types import Receive, Scope, Send

from omni_gateway.chat import ChatResult, completion_body, index_of, now, sse_chunks
from omni_gateway.edits import EditInputs, read_edit_request
from omni_gateway.errors import BadRequest, ModelNotFound, OmniError, StageFailed, Unavailable
from omni_gateway.events import AudioChunk, Event, ImageProgress, OfChoice, TextDelta, VideoProgress
from omni_gateway.images import final_images, image_stream, images_body
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.protocol.chat import (
    ChatCompletionRequest,
    sampling_params,
    stage_inputs,
    stage_sampling,
)
from omni_gateway.protocol.images import ImageGenerationRequest, image_inputs, image_sampling
from omni_gateway.protocol.omni import OmniSleepRequest, OmniWakeupRequest
from omni_gateway.protocol.speech import SPEECH_MEDIA_TYPES, SpeechRequest
from omni_gateway.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from omni_gateway.protocol.videos import read_video_request
from omni_gateway.request import PipelineRequest
from omni_gateway.sleep import stage_names
from omni_gateway.speech import audio_stream, sse_stream
from omni_gateway.videos.jobs import checked
from omni_gateway.videos.media import encode_mp4
from omni_gateway.voices.routes import voices_of
from omni_gateway.voices.voices import speech_asked
from omni_pipeline.control import DetokenizeMsg
from omni_pipeline.resource_metrics import COUNT_WAIT_S
from omni_pipeline.sampling import EVERY_ENGINE
from omni_pipeline.spec import OutputKind

router = APIRouter()
T = TypeVar("T")


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline  # type: ignore[no-any-return]


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


def _model(svc: Pipeline) -> dict[str, Any]:
    return {
        "id": svc.spec.served_model_name,
        "object": "model",
        "created": svc.started_at,
        "owned_by": "omni-pipeline",
        "modalities": sorted(k.value for k in svc.spec.output_kinds()),
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model(_pipeline(request))]}


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> dict[str, Any]:
    svc = _pipeline(request)
    if model != svc.spec.served_model_name:
        raise ModelNotFound(f"model '{model}' does not exist", param="model")
    return _model(svc)


@router.get("/health/live")
async def live() -> dict[str, str]:
    """The process answers (Kubernetes' liveness probe; /health says whether it can serve)."""
    return {"status": "alive"}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    svc = _pipeline(request)
    ok = svc.ready()
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m, svc = _metrics(request), _pipeline(request)
    m.tracked.set(svc.requests_in_flight())
    m.resources.refresh(svc.nats)
    connectors = list(svc.payloads.connectors.values())
    await svc.payloads.within(COUNT_WAIT_S, m.resources.count_connectors, connectors)  # or the last count
    encode, content_type = choose_encoder(request.headers.get("accept", ""))  # OpenMetrics: exemplars
    return Response(encode(m.registry), media_type=content_type)


@router.get("/replicas")
async def replicas(request: Request) -> dict[str, Any]:
    """The live replica table this gateway routes by (for operators)."""
    return {"replicas": _pipeline(request).replicas()}


@dataclass(frozen=True, slots=True)
class Streamed:
    """A response body sent as it is produced."""

    body: AsyncIterator[str] | AsyncIterator[bytes]
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)


async def _respond(
    request: Request,
    asked: PipelineRequest,
    respond: Callable[[str, Any, AsyncIterator[Any]], Awaitable[Response | Streamed]],
    n: int = 1,
    whole: bool = False,
) -> Response:
    """Check a request (once, in the pipeline API), run it (`n` > 1: its replies side by side,
    events as `OfChoice`), count it, wait for its first output (an error before any output
    keeps its HTTP status), then let `respond` build the response from it and the rest. A
    streamed body takes over the in-flight count; a client that leaves aborts the request.
    `whole`: the response is sent when the request ends, so a request moved to a fresh route
    starts over unseen."""
    svc = _pipeline(request)
    req = await svc.prepare(asked)
    rid: str = request.state.request_id  # the client's X-Request-Id, made unique (app.py)
    m = _metrics(request)
    t0 = time.monotonic()
    run = svc.run(rid, req, whole=whole) if n == 1 else svc.run_choices(rid, n, req, whole=whole)
    events = _observed(run, m, t0, rid)
    m.inflight.inc()
    streaming = False
    try:
        first = await _first(events, request)
        answer = await until_disconnect(respond(rid, first, events), request)
        if isinstance(answer, Streamed):
            body = _counted(answer.body, m, t0, rid)
            streaming = True
            return _Stream(body, events, media_type=answer.media_type, headers=answer.headers)
        m.latency.observe(time.monotonic() - t0, exemplar={"request_id": rid})
        return answer
    except BaseException:
        await events.aclose()
        raise
    finally:
        if not streaming:
            m.inflight.dec()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    async def respond(rid: str, first: Any, events: AsyncIterator[Any]) -> Response | Streamed:
        if req.stream:
            return Streamed(sse_chunks(req, rid, now(), first, events), "text/event-stream")
        results = [ChatResult() for _ in range(req.n)]
        for item in await _rest(first, events):
            i, ev = index_of(item)
            results[i].add(ev)
        return JSONResponse(completion_body(req, rid, now(), results))

    try:
        per_stage = stage_sampling(req, [s.name for s in _pipeline(request).spec.stages])
    except ValueError as exc:
        raise BadRequest(f"sampling_params_list: {exc}", param="sampling_params_list") from None
    asked = PipelineRequest(
        req.model,
        frozenset(req.wanted_outputs()),
        stage_inputs(req),
        sampling_params(req),
        outputs_param="modalities",
        voice_param="audio.voice",
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        declared=EVERY_ENGINE,
        per_stage=per_stage,
        priority=req.priority,
    )
    return await _respond(request, asked, respond, req.n, not req.stream)


@router.post("/v1/images/generations", response_model=None)
async def images_generations(req: ImageGenerationRequest, request: Request) -> Response:
    asked = PipelineRequest(req.model, frozenset({OutputKind.IMAGE}), image_inputs(req), image_sampling(req))
    return await _respond(request, asked, _images_respond(req), whole=not req.stream)


@router.post("/v1/images/edits", response_model=None)
async def images_edits(request: Request) -> Response:
    """OpenAI's image edit (a multipart form: the images, a mask, the fields of a generation;
    or its JSON, the images as URLs), answered as a generation is; see omni_gateway.edits."""
    req, edit = await read_edit_request(request, _pipeline(request).spec.gateway.media)
    asked = PipelineRequest(
        req.model,
        frozenset({OutputKind.IMAGE}),
        image_inputs(req, edit.references),
        image_sampling(req),
        media=edit.media.tensors,
    )
    return await _respond(request, asked, _images_respond(req, edit), whole=not req.stream)


def _images_respond(
    req: ImageGenerationRequest, edit: EditInputs | None = None
) -> Callable[[str, Event, AsyncIterator[Event]], Awaitable[Response | Streamed]]:
    """An images response, whole or streamed; an edit's images kept to its mask."""

    async def respond(_: str, first: Event, events: AsyncIterator[Event]) -> Response | Streamed:
        if edit is not None:
            first, events = await edit.kept(first), edit.all_kept(events)
        if req.stream:
            return Streamed(image_stream(req, now(), first, events), "text/event-stream")
        final, finished = final_images(await _rest(first, events))
        return JSONResponse(await images_body(req, now(), final, finished))

    return respond


@router.post("/v1/videos/sync", response_model=None)
async def videos_sync(request: Request) -> Response:
    """vLLM-Omni's synchronous video generation: the form of POST /v1/videos, answered with the
    MP4 itself once it is made (no job, nothing kept)."""
    req = await read_video_request(request)
    t0 = time.monotonic()

    async def respond(rid: str, first: Event, events: AsyncIterator[Event]) -> Response:
        final = next(
            (ev for ev in await _rest(first, events) if isinstance(ev, VideoProgress) and ev.is_last), None
        )
        if final is None or not final.videos:
            raise StageFailed("the pipeline ended without a video")
        mp4 = await asyncio.to_thread(encode_mp4, final.videos[0], final.fps)
        headers = {
            "X-Model": _pipeline(request).spec.served_model_name,
            "X-Inference-Time-S": f"{time.monotonic() - t0:.3f}",
        }
        return Response(mp4, media_type="video/mp4", headers=headers)

    asked = await checked(_pipeline(request), req, progress=False)
    return await _respond(request, asked, respond, whole=True)


@router.post("/v1/audio/speech", response_model=None)
async def audio_speech(req: SpeechRequest, request: Request) -> Response:
    async def respond(_: str, first: Event, events: AsyncIterator[Event]) -> Response | Streamed:
        if not isinstance(first, AudioChunk):
            raise StageFailed("the pipeline ended without producing audio")
        headers = {"X-Sample-Rate": str(first.sample_rate)}
        if req.stream_format == "sse":
            return Streamed(sse_stream(req, first, events), "text/event-stream", headers)
        return Streamed(audio_stream(req, first, events), SPEECH_MEDIA_TYPES[req.response_format], headers)

    return await _respond(request, await speech_asked(request.app.state.voices, req), respond)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: the ids the source stage reads for a prompt or for chat messages."""
    svc = _pipeline(request)
    _check_model_name(svc, req.model)
    got = await svc.tokenize(req.message())
    return {
        "count": len(got.tokens),
        "max_model_len": got.max_model_len,
        "tokens": got.tokens,
        "token_strs": got.token_strs if req.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
    svc = _pipeline(request)
    _check_model_name(svc, req.model)
    return {"prompt": (await svc.tokenize(DetokenizeMsg(req.tokens))).prompt}


def _check_model_name(svc: Pipeline, model: str | None) -> None:
    if model is not None and model != svc.spec.served_model_name:
        raise ModelNotFound(f"model '{model}' does not exist", param="model")


@router.get("/v1/audio/voices")
async def audio_voices(request: Request) -> dict[str, Any]:
    """The voices the pipeline speaks in, and those uploaded, as vLLM-Omni lists them; 404 for
    a pipeline that does not speak, 503 while its speaking stages have not all announced theirs."""
    svc = _pipeline(request)
    uploaded = voices_of(request)
    voices = svc.voices()
    if voices is None:
        raise Unavailable("the stages that speak have not all announced their voices yet")
    return {"voices": sorted(voices), "uploaded_voices": [v.listing() for v in await uploaded.all()]}


@router.post("/v1/omni/sleep")
async def omni_sleep(req: OmniSleepRequest, request: Request) -> dict[str, Any]:
    """Put stages to sleep (see omni_gateway.sleep); the answer comes once they all are."""
    svc = _pipeline(request)
    return await svc.sleep(stage_names(svc.spec, req.stage_ids), req.level, req.pause_mode())


@router.post("/v1/omni/wakeup")
async def omni_wakeup(req: OmniWakeupRequest, request: Request) -> dict[str, Any]:
    svc = _pipeline(request)
    return await svc.wake(stage_names(svc.spec, req.stage_ids))


async def _observed(
    events: AsyncGenerator[Any], m: GatewayMetrics, t0: float, rid: str
) -> AsyncGenerator[Any]:
    """A request's events as they pass: the time to its first output of each kind, and the code
    of the error that ended it. Closing this closes `events` (which aborts the request)."""
    seen: set[str] = set()
    async with contextlib.aclosing(events):
        try:
            async for item in events:
                kind = _OUTPUT_OF.get(type(item.event if isinstance(item, OfChoice) else item))
                if kind is not None and kind not in seen:
                    seen.add(kind)
                    elapsed = time.monotonic() - t0
                    m.first_output.labels(output=kind).observe(elapsed, exemplar={"request_id": rid})
                yield item
        except OmniError as exc:
            m.errors.labels(code=exc.code or f"http_{exc.status}").inc()
            raise


_OUTPUT_OF: Final = {TextDelta: "text", AudioChunk: "audio", ImageProgress: "image", VideoProgress: "video"}


async def _rest(first: T, events: AsyncIterator[T]) -> list[T]:
    """The first event and all that follow it (for a whole, non-streamed response)."""
    return [first, *[ev async for ev in events]]


async def _first(events: AsyncIterator[T], request: Request) -> T:
    async def first() -> T:
        return await anext(events)

    return await until_disconnect(first(), request)


async def until_disconnect(coro: Any, request: Request) -> Any:
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


class _Stream(StreamingResponse):
    """A streamed response that ends its request when it ends, however it ends. Starlette leaves
    a body whose client went away to the garbage collector, and with it the request's abort:
    seconds later under load (whenever a collection frees the traceback's frames), the
    request running all that while."""

    def __init__(
        self, body: AsyncGenerator[str], events: AsyncGenerator[Any], media_type: str, headers: dict[str, str]
    ) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self._body, self._events = body, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._events.aclose()  # aborts the request, if it had not ended


async def _counted(chunks: AsyncIterator[str], m: GatewayMetrics, t0: float, rid: str) -> AsyncGenerator[str]:
    try:
        async for c in chunks:
            yield c
    finally:
        m.inflight.dec()
        m.latency.observe(time.monotonic() - t0, exemplar={"request_id": rid})
