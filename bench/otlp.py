"""An OTLP/HTTP trace endpoint on loopback, for the tracing benchmark and tests: it decodes each
export (the protobuf an OpenTelemetry collector receives on :4318/v1/traces) and keeps its spans.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    """"" for a root span."""
    kind: int
    """The protobuf's SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer."""
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    """0 unset, 1 ok, 2 error."""
    start_ns: int
    end_ns: int


class OtlpReceiver:
    """Listens at `url` (give it as OTEL_EXPORTER_OTLP_ENDPOINT) until `close()`. Without
    `decode`, it only counts exports and bytes (a benchmark's load must not share the GIL
    with protobuf decoding)."""

    def __init__(self, decode: bool = True) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.exports = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != TRACES_PATH:
                    self.send_error(404)
                    return
                with receiver._lock:
                    receiver.exports += 1
                    receiver.bytes += len(body)
                if decode:
                    receiver._take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp", daemon=True)
        self._thread.start()

    def _take(self, export: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in export.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes=_attributes(s.attributes),
                            resource=resource,
                            status_code=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return getattr(v, which) if which else None
