"""OpenTelemetry traces: a request is one trace, from the gateway's HTTP span through every stage
replica it visits, the W3C trace context riding in the headers of the NATS messages between them.

Off unless an OTLP endpoint is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT,
or the pipeline's `observability.otlpEndpoint`). Off, `TRACER` is the API's no-op tracer, `span`
and `within` are no-ops (the API's own no-op span made current costs ~10 us, a few percent of
a trivial request), and no message carries headers. On, spans leave in batches from a
background thread (the SDK's BatchSpanProcessor), over OTLP/HTTP (protobuf) or, when
OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says `grpc`, OTLP/gRPC. The other standard OTEL_ variables
(sampler, batch delays, headers, resource attributes) apply as the SDK reads them; the service
name and the attributes given here win over OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind

log = logging.getLogger(__name__)

TRACER: Final = trace.get_tracer("omni_pipeline")
"""Every omni span comes from this tracer; it follows whatever provider the process set."""
ENDPOINT_ENVS: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_ENVS: Final = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
FLUSH_TIMEOUT_S: Final = 2.0
"""At exit, how long the spans not yet sent may take to go: a collector that is down must not
hold up a process's exit (the supervisor kills a child that takes 5 s)."""

_provider: TracerProvider | None = None
_OFF: Final = contextlib.nullcontext(trace.INVALID_SPAN)


class TracingError(RuntimeError):
    """The tracing settings cannot work (an unknown protocol, a missing exporter package)."""


def configure_tracing(service: str, otlp_endpoint: str | None, **attributes: str) -> bool:
    """Export this process's spans as `service` when an endpoint is set; returns whether it is.

    `otlp_endpoint` is the pipeline's (a collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT
    is); the environment wins over it. `attributes` go on the resource (pipeline, stage,
    replica), under the names the caller gives."""
    global _provider
    if _provider is not None or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return _provider is not None
    from_env = next((os.environ[e] for e in ENDPOINT_ENVS if os.environ.get(e)), None)
    if not (from_env or otlp_endpoint):
        return False
    protocol = next((os.environ[e] for e in PROTOCOL_ENVS if os.environ.get(e)), "http/protobuf")
    exporter = _exporter(protocol.strip().lower(), None if from_env else otlp_endpoint)
    resource = Resource.create({"service.name": service, **attributes})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # shutdown_tracing bounds it
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on: OTLP %s to %s", protocol, from_env or otlp_endpoint)
    return True


def _exporter(protocol: str, endpoint: str | None) -> SpanExporter:
    """The OTLP exporter for `protocol`; `endpoint` (a base URL) only when the environment
    names none (the exporters read it themselves)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = f"{endpoint.rstrip('/')}/v1/traces" if endpoint else None
        return OTLPSpanExporter(endpoint=url)
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise TracingError(
                "OTLP protocol grpc needs the package opentelemetry-exporter-otlp-proto-grpc "
                "(pip install 'omni-pipeline[otlp-grpc]'); http/protobuf needs nothing more"
            ) from None
        return GrpcSpanExporter(endpoint=endpoint)
    raise TracingError(f"OTLP protocol {protocol!r}: omni-pipeline exports http/protobuf or grpc")


def tracing_on() -> bool:
    return _provider is not None


def shutdown_tracing() -> None:
    """At process exit: send what is left, for at most FLUSH_TIMEOUT_S (the SDK's own shutdown
    waits out the exporter's retries, 10 s and more; its threads are daemons, gone at exit)."""
    global _provider
    if _provider is None:
        return
    sending = threading.Thread(target=_provider.shutdown, name="otel-shutdown", daemon=True)
    sending.start()
    sending.join(FLUSH_TIMEOUT_S)
    _provider = None


def span(
    name: str,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict[str, Any] | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """A span, current for the block (an exception leaving it marks it failed); off, nothing."""
    if _provider is None:
        return _OFF
    return TRACER.start_as_current_span(name, context, kind, attributes)


def within(span: Span) -> contextlib.AbstractContextManager[Span]:
    """`span` current for the block, ended after it; off, nothing."""
    if _provider is None:
        return _OFF
    return trace.use_span(span, end_on_exit=True)


def adopt(span: Span) -> None:
    """Make `span` the current one for the rest of this task (its own context: a request's)."""
    if _provider is not None:
        otel_context.attach(trace.set_span_in_context(span))


def headers(context: Context | None = None) -> dict[str, str] | None:
    """The W3C trace context of `context` (default: the current one) as message headers; None
    when tracing is off or there is nothing to carry."""
    if _provider is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier or None


def extract(carried: Mapping[str, str] | None) -> Context | None:
    """The context a message's headers carry, to parent or link the spans it leads to."""
    if _provider is None or not carried:
        return None
    return propagate.extract(carried)
