"""The gateway application: FastAPI app, error mapping, X-Request-Id, and the process entry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from setproctitle import setproctitle
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_gateway.batches.routes import router as batches_router
from omni_gateway.batches.runner import BatchRunner
from omni_gateway.chat_batch import router as chat_batch_router
from omni_gateway.errors import BadRequest, OmniError
from omni_gateway.guards import ApiKeyAuth, BodyLimit, load_api_keys
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.page import router as page_router
from omni_gateway.realtime.socket import LiveSessions
from omni_gateway.realtime.socket import router as realtime_router
from omni_gateway.realtime.speech_stream import router as speech_stream_router
from omni_gateway.routes import router
from omni_gateway.speech_batch import router as speech_batch_router
from omni_gateway.videos.jobs import VideoJobs
from omni_gateway.videos.routes import router as videos_router
from omni_gateway.voices.routes import router as voices_router
from omni_gateway.voices.voices import Voices
from omni_pipeline.lifecycle import exit_if_stuck
from omni_pipeline.logs import REQUEST_ID, configure_logging
from omni_pipeline.serving import listen, make_server, on_shutdown_signals
from omni_pipeline.spec import OutputKind, PipelineFile
from omni_pipeline.tracing import configure_tracing, shutdown_tracing

log = logging.getLogger("omni.gateway")

_CLIENT_ID_OK: Final = re.compile(r"^[A-Za-z0-9_.-]{1,96}$")
"""A client's X-Request-Id the pipeline can carry: its ids go into NATS messages, segment names
and store keys (see `check_request_id`), with room for the suffix."""
READY_WAIT_S: Final = 60.0
SESSIONS_CLOSE_S: Final = 10.0
"""At shutdown, how long live sessions have to be closed (a duplex session ends its response
first) before the server stops anyway."""


def pipeline_request_id(client_id: str) -> str:
    """The id a request has inside the pipeline (every stage's log lines, metric exemplars):
    the client's own id, with a suffix that keeps two requests sent with one id apart."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}"


class RequestIdMiddleware:
    """Honour X-Request-Id and echo it on every response, streaming included. An id the
    pipeline cannot carry (or none) is replaced by one made here, and that one is returned."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        if _CLIENT_ID_OK.match(given):
            rid, pipeline_rid = given, pipeline_request_id(given)
        else:
            rid = pipeline_rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = pipeline_rid
        trace.get_current_span().set_attribute("omni.request_id", pipeline_rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-request-id", rid.encode("latin-1")))
            await send(message)

        token = REQUEST_ID.set(pipeline_rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class StatusCounter:
    """Count responses by status (pure ASGI: BaseHTTPMiddleware would break streaming disconnects)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _error_response(err: OmniError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(
    pipeline: Pipeline,
    lifespan: Callable[[FastAPI], Any] | None = None,
    api_keys: frozenset[str] = frozenset(),
) -> FastAPI:
    app = FastAPI(title="omni-pipeline gateway", lifespan=lifespan)
    app.state.pipeline = pipeline
    app.state.metrics = metrics = GatewayMetrics(lambda: pipeline.migrations)
    app.include_router(router)
    app.include_router(realtime_router)
    app.include_router(page_router)
    app.include_router(speech_stream_router)
    app.include_router(speech_batch_router)
    app.include_router(videos_router)
    app.include_router(voices_router)
    app.include_router(batches_router)
    app.include_router(chat_batch_router)
    app.state.api_keys_required = bool(api_keys)
    app.state.video_jobs = None  # set while serving, for a pipeline that makes video
    app.state.batches = None  # set while serving, where its store could be opened
    # What the batch runner's requests to this app carry: a key of this process's own, never shown.
    app.state.internal_key = secrets.token_urlsafe(32)
    app.state.voices = None  # set while serving, for a pipeline that speaks
    realtime = pipeline.spec.gateway.realtime
    app.state.live_sessions = LiveSessions(realtime.max_sessions, realtime.resume_grace_s, metrics)
    # Added innermost first: the key is checked before the body is read; every answer, the
    # guards' included, carries X-Request-Id and is counted.
    gateway = pipeline.spec.gateway
    uploads = {"/v1/files": gateway.batches.max_file_bytes + (1 << 20)}  # the file, and its form's fields
    app.add_middleware(BodyLimit, max_bytes=gateway.max_request_bytes, larger=uploads)
    app.add_middleware(ApiKeyAuth, keys=api_keys | {app.state.internal_key} if api_keys else api_keys)
    app.add_middleware(RequestIdMiddleware)

    app.add_middleware(StatusCounter, metrics=metrics)

    @app.exception_handler(OmniError)
    async def on_omni(_: Request, exc: OmniError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":  # as OpenAI words it
            msg = "unrecognized request argument"
        param = ".".join(loc) or None
        text = f"{param}: {msg}" if param else msg
        return _error_response(BadRequest(text, param=param))

    @app.exception_handler(HTTPException)
    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        err = OmniError(str(exc.detail))
        err.status, err.type = (
            exc.status_code,
            "invalid_request_error" if exc.status_code < 500 else "server_error",
        )
        return _error_response(err)

    @app.exception_handler(Exception)
    async def on_crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway: unhandled error")
        return _error_response(OmniError(f"internal error: {type(exc).__name__}"))

    return app


def run_gateway(
    ready: Callable[[dict[str, Any]], None],
    pipeline: PipelineFile,
    nats_url: str,
    host: str,
    port: int,
    wait_for_stages: bool = True,
) -> None:
    """Process entry point (`omni gateway`, and `omni serve` through the lifecycle)."""
    configure_logging()
    setproctitle("omni: gateway")
    api_keys = load_api_keys()  # before anything starts: bad key settings stop the gateway here
    log.info("gateway: API keys %s", f"required ({len(api_keys)})" if api_keys else "off")
    traced = configure_tracing(
        "omni-gateway", pipeline.spec.observability.otlp_endpoint, **{"service.namespace": pipeline.name}
    )

    async def main() -> None:
        service = Pipeline(pipeline, nats_url)
        stopping = asyncio.Event()

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            if not await service.start(stop=stopping):
                log.info("gateway %s: stopped before NATS was reachable", service.gateway_id)
                yield  # the server is already told to exit
                return
            if wait_for_stages:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(READY_WAIT_S):
                        await service.covered()
            jobs = None
            if OutputKind.VIDEO in pipeline.spec.output_kinds():
                jobs = await VideoJobs.open(service, pipeline.name, app.state.metrics)
                await jobs.start()
                app.state.video_jobs = jobs
            batches = app.state.batches = await BatchRunner.open(app, service, pipeline.name)
            if batches is not None:
                await batches.start()
            voices = None
            if OutputKind.AUDIO in pipeline.spec.output_kinds():
                voices = app.state.voices = await Voices.open(service, pipeline.name)
            ready({"port": sock.getsockname()[1], "gateway_id": service.gateway_id})
            log.info(
                "gateway %s serving %s on http://%s:%d",
                service.gateway_id,
                pipeline.spec.served_model_name,
                host,
                sock.getsockname()[1],
            )
            yield
            exit_if_stuck()  # done serving: closing must not hold the process (or a pod) for ever
            if jobs is not None:
                await jobs.stop()  # its running jobs go back to the queue, for the next gateway
            if batches is not None:
                await batches.stop()  # its batches too, their lines in flight to run again
            if voices is not None:
                await voices.close()
            await service.stop()

        sock = listen(host, port)
        app = build_app(service, lifespan, api_keys)
        if traced:  # only then: off, not even a middleware is added
            FastAPIInstrumentor.instrument_app(
                app, excluded_urls="/health,/metrics", exclude_spans=["receive", "send"]
            )
        # A socket's message is a request body too: the same limit (larger ones close it, 1009).
        server = make_server(
            app, timeout_graceful_shutdown=30, ws_max_size=pipeline.spec.gateway.max_request_bytes
        )

        closing: list[asyncio.Task[None]] = []

        async def close_then_exit() -> None:
            try:
                async with asyncio.timeout(SESSIONS_CLOSE_S):
                    await app.state.live_sessions.close_all("the gateway is shutting down")
            except Exception:  # its timeout among them: the server's shutdown closes what is left
                log.exception("gateway %s: live sessions not all closed at shutdown", service.gateway_id)
            finally:
                server.should_exit = True  # whatever happened above: the gateway stops

        def stop() -> None:
            """Live sessions are closed (1001, a reason) before the server's shutdown begins:
            it closes the sockets still open itself, with 1012. A second signal exits at once."""
            stopping.set()
            if closing:
                server.should_exit = True
                return
            closing.append(asyncio.get_running_loop().create_task(close_then_exit(), name="close-sessions"))

        on_shutdown_signals(stop)
        await server.serve(sockets=[sock])

    try:
        asyncio.run(main())
    finally:
        shutdown_tracing()
