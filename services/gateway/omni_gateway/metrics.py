"""Prometheus metrics of one gateway."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_pipeline.resource_metrics import ResourceGauges

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "omni_gateway_requests", "Requests answered, by HTTP status", ["status"], registry=r
        )
        self.inflight = Gauge("omni_gateway_inflight_requests", "Requests being served", registry=r)
        self.tracked = Gauge("omni_gateway_tracked_requests", "Per-request states held", registry=r)
        self.resources = ResourceGauges(r, {})
        self.latency = Histogram(
            "omni_gateway_request_seconds", "Request latency", buckets=_BUCKETS, registry=r
        )
        self.first_output = Histogram(
            "omni_gateway_time_to_first_output_seconds",
            "Request start to first output",
            buckets=_BUCKETS,
            registry=r,
        )
