"""What the processes of a running pipeline tell about its requests, checked against a live one:
the Distributed tiny demo (a gateway, a thinker, a talker and a vocoder, each its own `omni`
process; a real nats-server and Mooncake), exporting traces to a real OTLP/HTTP endpoint in the
test, whose protobuf exports are decoded.

- One request is one trace, with spans from every process it visited, each parented by the span
  that sent it work, and log lines that name the request and the trace.
- docs/observability.md names exactly the metrics the gateway and the stage replicas export, and
  the chart's Grafana dashboard queries only metrics they export.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from websockets.sync.client import connect

from bench.otlp import OtlpReceiver, ReceivedSpan
from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from tests.deployment import Deployment, deployed
from tests.helpers import HTTP, ROOT, metric, metric_families, openai_client, replicas, wait_for

DEMO = ROOT / "examples" / "tiny-omni-distributed.yaml"
STAGES = ("thinker", "talker", "vocoder")
SERVER, CLIENT = 2, 3  # the protobuf's SpanKind
ERROR = 2
DOCS = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "charts" / "omni-pipeline" / "dashboards" / "omni-pipeline.json"


@dataclass
class Traced:
    deployment: Deployment
    receiver: OtlpReceiver
    logs: dict[str, str]
    """Each stage replica's output, after the request."""


@pytest.fixture(scope="module")
def traced(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """The demo with tracing on, after one text+audio request through it."""
    logs = tmp_path_factory.mktemp("observability")
    nats, mooncake, receiver = EmbeddedNats(), LocalMooncake(logs), OtlpReceiver()
    env = {**mooncake.env(), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with deployed(DEMO, dict.fromkeys(STAGES, 1), 1, nats.url, demo_dir, logs, env) as d:
            raw = openai_client(d.base).chat.completions.with_raw_response.create(
                model="tiny-omni",
                messages=[{"role": "user", "content": "trace me"}],
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
                extra_headers={"X-Request-Id": "traced"},
            )
            assert raw.parse().choices[0].message.audio.data
            assert raw.headers["x-request-id"] == "traced"
            t = Traced(d, receiver, {})

            def complete() -> bool:
                services = {s.service for s in trace_of_request(t) if s.kind == SERVER}
                return services >= {"omni-gateway", *(f"omni-stage-{s}" for s in STAGES)}

            wait_for(complete, 30, "spans from the gateway and every stage replica")
            t.logs = {name: p.output() for name, p in d.stages.items()}
            yield t
    finally:
        receiver.close()
        mooncake.stop()
        nats.stop()


def trace_of_request(t: Traced) -> list[ReceivedSpan]:
    spans = t.receiver.spans()
    ours = [s for s in spans if str(s.attributes.get("omni.request_id", "")).startswith("traced-")]
    return [s for s in spans if ours and s.trace_id == ours[0].trace_id]


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        named[s.name].append(s)
    return named


@pytest.mark.slow
def test_a_request_is_one_trace_through_every_replica(traced: Traced) -> None:
    logs = traced.logs
    spans = trace_of_request(traced)
    ids = {s.span_id: s for s in spans}
    named = by_name(spans)
    # The gateway's HTTP span is the root (the client sent no trace context of its own).
    (http,) = [s for s in spans if s.service == "omni-gateway" and s.kind == SERVER]
    assert http.parent_id == "" and http.attributes["http.route"] == "/v1/chat/completions"
    rid = http.attributes["omni.request_id"]
    assert rid.startswith("traced-")
    (attempt,) = named["omni.request"]
    assert attempt.parent_id == http.span_id and attempt.attributes["omni.request_id"] == rid
    assert {attempt.attributes[f"omni.route.{s}"] for s in STAGES} == {"a"}
    admits = {s.attributes["omni.stage"]: s for s in named["omni.admit"]}
    assert set(admits) == set(STAGES)
    assert all(a.parent_id == attempt.span_id and a.kind == CLIENT for a in admits.values())

    for stage in STAGES:
        (request,) = [s for s in named["omni.stage.request"] if s.attributes["omni.stage"] == stage]
        # Parented across the process boundary by the span whose message carried its context.
        assert request.parent_id == admits[stage].span_id
        assert request.service == f"omni-stage-{stage}" and request.resource["omni.replica"] == "a"
        assert request.attributes["omni.outcome"] == "ok" and request.status_code != ERROR
        children = by_name([s for s in spans if s.parent_id == request.span_id])
        assert len(children["omni.stage.queue"]) == 1
        assert children["omni.engine.call"], stage
        for call in children["omni.engine.call"]:
            assert request.start_ns <= call.start_ns <= call.end_ns <= request.end_ns
        # Its log lines name the request and the trace.
        assert f"request={rid} trace={request.trace_id}" in logs[f"{stage}-a"], stage

    def edge(op: str, stage: str, peer: str) -> list[ReceivedSpan]:
        return [
            s
            for s in named[f"omni.connector.{op}"]
            if s.service == f"omni-stage-{stage}" and s.attributes["omni.peer"] == peer
        ]

    # Each connector span sits under an engine call of its own stage, with its bytes.
    for op, stage, peer in [
        ("put", "thinker", "talker"),
        ("get", "talker", "thinker"),
        ("put", "talker", "vocoder"),
        ("get", "vocoder", "talker"),
        ("put", "vocoder", "gateway"),
    ]:
        found = edge(op, stage, peer)
        assert found, (op, stage, peer)
        assert all(s.attributes["omni.bytes"] > 0 for s in found)
        assert all(ids[s.parent_id].name in ("omni.engine.call", "omni.stage.request") for s in found)
    # The hidden states went through Mooncake (the demo's default connector for tensors).
    assert {s.attributes["omni.connector.kind"] for s in edge("put", "thinker", "talker")} == {"mooncake"}


@pytest.mark.slow
def test_each_live_turn_is_one_trace_through_every_replica(traced: Traced) -> None:
    """A live session's responses (WS /v1/realtime): each is a trace of its own, rooted at its
    `omni.realtime.response` span, reaching every stage replica; not one trace per socket."""
    responses = []
    with connect(traced.deployment.base.replace("http://", "ws://") + "/v1/realtime") as ws:
        json.loads(ws.recv())
        for text in ("one", "two"):
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4}}))
            while (event := json.loads(ws.recv()))["type"] != "response.done":
                pass
            responses.append(event["response"]["id"])

    def turns() -> dict[str, list[ReceivedSpan]]:
        spans = traced.receiver.spans()
        roots = {s.attributes.get("omni.response_id"): s for s in spans if s.name == "omni.realtime.response"}
        return {r: [s for s in spans if s.trace_id == roots[r].trace_id] for r in responses if r in roots}

    def complete() -> bool:
        found = turns()
        every = {"omni-gateway", *(f"omni-stage-{s}" for s in STAGES)}
        return len(found) == 2 and all({s.service for s in spans} >= every for spans in found.values())

    wait_for(complete, 30, "each turn's spans from the gateway and every stage replica")
    found = turns()
    (first,), (second,) = ([s for s in found[r] if s.name == "omni.realtime.response"] for r in responses)
    assert first.trace_id != second.trace_id and first.parent_id == second.parent_id == ""
    assert first.attributes["omni.outcome"] == "incomplete"
    for root in (first, second):
        (attempt,) = [s for s in found[root.attributes["omni.response_id"]] if s.name == "omni.request"]
        assert attempt.parent_id == root.span_id


def exported(t: Traced) -> dict[str, str]:
    """Every family the gateway and the stage replicas export."""
    base = t.deployment.base
    urls = [f"{base}/metrics"] + [
        f"http://127.0.0.1:{r['metrics_port']}/metrics" for stage in STAGES for r in replicas(base, stage)
    ]
    assert len(urls) == 1 + len(STAGES)
    out: dict[str, str] = {}
    for url in urls:
        out |= {name: f.type for name, f in metric_families(url).items()}
    return out


SAMPLES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.mark.slow
def test_the_docs_name_exactly_the_metrics_exported(traced: Traced) -> None:
    ours = {name for name in exported(traced) if name.startswith("omni_")}
    documented = {
        n.removesuffix("_total")
        for n in re.findall(r"`(omni_[a-z_]+)`", DOCS.read_text())
        if not n.startswith("omni_operator_")  # the operator's: tests/integration/test_operator.py
    }
    assert ours - documented == set(), "exported, not in docs/observability.md"
    assert documented - ours == set(), "in docs/observability.md, not exported"


@pytest.mark.slow
def test_the_dashboard_queries_only_exported_metrics(traced: Traced) -> None:
    samples = {
        name + suffix for name, kind in exported(traced).items() for suffix in SAMPLES.get(kind, ("",))
    }
    queried = {
        m
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel["targets"]
        for m in re.findall(r"\b((?:omni|process)_[a-z_]+)", target["expr"])
    }
    assert len(queried) >= 15
    assert queried - samples == set()


def gateway_sample(base: str, name: str, **labels: str) -> float:
    return metric(f"{base}/metrics", name, **labels)


@pytest.mark.slow
def test_the_gateway_times_each_output_kind_and_counts_failures_by_code(traced: Traced) -> None:
    base = traced.deployment.base
    first = "omni_gateway_time_to_first_output_seconds_count"
    assert gateway_sample(base, first, output="text") >= 1  # TTFT
    assert gateway_sample(base, first, output="audio") >= 1  # TTFA
    assert gateway_sample(base, first, output="image") == 0
    asleep = gateway_sample(base, "omni_gateway_errors_total", code="stage_asleep")
    r = HTTP.post(f"{base}/v1/omni/sleep", json={"stage_ids": ["vocoder"], "level": 0}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        r = HTTP.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny-omni",
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["audio"],
            },
            headers={"X-Request-Id": "asleep"},
            timeout=30,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "stage_asleep"
    finally:
        assert (
            HTTP.post(f"{base}/v1/omni/wakeup", json={"stage_ids": ["vocoder"]}, timeout=30).status_code
            == 200
        )
    assert gateway_sample(base, "omni_gateway_errors_total", code="stage_asleep") == asleep + 1

    def failed_attempt() -> list[ReceivedSpan]:
        return [
            s
            for s in traced.receiver.spans()
            if s.name == "omni.request" and str(s.attributes["omni.request_id"]).startswith("asleep-")
        ]

    wait_for(lambda: failed_attempt() != [], 30, "the refused request's span")
    (attempt,) = failed_attempt()
    assert attempt.status_code == ERROR
