"""Tracing's settings and the log lines' ids, in-process. What crosses processes (spans from the
gateway and every stage in one trace, their parents) is tests/e2e/test_observability.py."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from omni_pipeline import tracing
from omni_pipeline.logs import REQUEST_ID, RequestIds

ENVS = (*tracing.ENDPOINT_ENVS, *tracing.PROTOCOL_ENVS, "OTEL_SDK_DISABLED")


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


def test_off_without_an_endpoint() -> None:
    assert not tracing.configure_tracing("omni-test", None)
    assert not tracing.tracing_on()
    with tracing.TRACER.start_as_current_span("s"):
        assert tracing.headers() is None  # no message carries anything
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None


def test_disabled_by_the_sdk_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configure_tracing("omni-test", "http://127.0.0.1:4318")
    assert not tracing.tracing_on()


@pytest.mark.parametrize("env", tracing.PROTOCOL_ENVS)
def test_an_unknown_protocol_is_refused(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv(env, "http/json")
    with pytest.raises(tracing.TracingError, match=r"'http/json'.*http/protobuf or grpc"):
        tracing.configure_tracing("omni-test", "http://127.0.0.1:4318")
    assert not tracing.tracing_on()


def record() -> logging.LogRecord:
    r = logging.LogRecord("omni.test", logging.INFO, __file__, 1, "hello", None, None)
    assert RequestIds().filter(r)
    return r


def test_log_lines_name_the_request_and_its_trace() -> None:
    assert record().ids == ""  # type: ignore[attr-defined]
    token = REQUEST_ID.set("req-1")
    try:
        assert record().ids == " [request=req-1]"  # type: ignore[attr-defined]
        tracer = TracerProvider().get_tracer("test")  # a provider of its own: nothing global
        with tracer.start_as_current_span("s") as span:
            trace_id = f"{span.get_span_context().trace_id:032x}"
            assert record().ids == f" [request=req-1 trace={trace_id}]"  # type: ignore[attr-defined]
    finally:
        REQUEST_ID.reset(token)
