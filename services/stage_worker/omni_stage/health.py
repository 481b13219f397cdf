"""The stage replica's own HTTP port: /health/live, /health/ready, /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


def health_app(
    registry: CollectorRegistry,
    is_ready: Callable[[], tuple[bool, str, str]],
    refresh: Callable[[], Awaitable[None]],
) -> FastAPI:
    """`is_ready` says: ready or not (200 or 503), the status word, and why."""
    app = FastAPI(title="omni stage replica", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health/live")
    def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/health/ready")
    def ready(response: Response) -> dict[str, str]:
        ok, status, why = is_ready()
        if not ok:
            response.status_code = 503
        return {"status": status, "reason": why}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        await refresh()  # this moment's figures, not the last heartbeat's
        encode, content_type = choose_encoder(request.headers.get("accept", ""))  # OpenMetrics: exemplars
        return Response(encode(registry), media_type=content_type)

    return app
