"""A replica's connector I/O: off its event loop (omni_pipeline.connectors.offload), timed and traced."""

from __future__ import annotations

import time
from typing import Any

from omni_pipeline import tracing
from omni_pipeline.connectors import ConnectorHandle, OmniConnector
from omni_pipeline.connectors.offload import OffLoop
from omni_stage.metrics import StageMetrics


class Transfers(OffLoop):
    """One replica's connector calls, each timed into its metrics and traced as a span."""

    def __init__(self, stage: str, connectors: dict[str, OmniConnector], metrics: StageMetrics) -> None:
        super().__init__(f"stage {stage}", connectors)
        self.stage = stage
        self.metrics = metrics

    async def send(
        self, conn: OmniConnector, consumer: str, request_id: str, data: Any, seq: int
    ) -> tuple[int, ConnectorHandle]:
        """Write a payload for `consumer`; returns its size and the handle that reads it."""
        with tracing.span("omni.connector.put", attributes=_edge(conn, consumer)) as span:
            t = time.perf_counter()
            _, nbytes, handle = await self.put(conn, self.stage, consumer, request_id, data, seq)
            self.metrics.connector(conn.name, "put", consumer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return nbytes, handle

    async def receive(
        self, conn: OmniConnector, producer: str, request_id: str, handle: ConnectorHandle
    ) -> Any:
        """Read (and so free) a payload `producer` wrote for this stage."""
        with tracing.span("omni.connector.get", attributes=_edge(conn, producer)) as span:
            t = time.perf_counter()
            payload, nbytes = await self.get(conn, producer, self.stage, request_id, handle)
            self.metrics.connector(conn.name, "get", producer, nbytes, time.perf_counter() - t)
            span.set_attribute("omni.bytes", nbytes)
        return payload


def _edge(conn: OmniConnector, peer: str) -> dict[str, str]:
    return {"omni.connector": conn.name, "omni.connector.kind": conn.kind, "omni.peer": peer}
