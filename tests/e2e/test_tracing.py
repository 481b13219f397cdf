"""Traces across processes: the Distributed tiny demo (a gateway, a thinker, a talker and a
vocoder, each its own `omni` process; a real nats-server and Mooncake) exporting to a real
OTLP/HTTP endpoint in the test, whose protobuf exports are decoded. One request is one trace,
with spans from every process it visited, each parented by the span that sent it work."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from bench.otlp import OtlpReceiver, ReceivedSpan
from omni_cli.mooncaked import LocalMooncake
from tests.deployment import deployed
from tests.helpers import ROOT, openai_client, wait_for

DEMO = ROOT / "examples" / "tiny-omni-distributed.yaml"
STAGES = ("thinker", "talker", "vocoder")
SERVER, CLIENT = 2, 3  # the protobuf's SpanKind
ERROR = 2


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        named[s.name].append(s)
    return named


@pytest.mark.slow
def test_a_request_is_one_trace_through_every_replica(
    nats_url: str, mooncake: LocalMooncake, demo_dir: Path, tmp_path: Path
) -> None:
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with deployed(DEMO, dict.fromkeys(STAGES, 1), 1, nats_url, demo_dir, tmp_path, env) as d:
            client = openai_client(d.base)
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-omni",
                messages=[{"role": "user", "content": "trace me"}],
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
                extra_headers={"X-Request-Id": "traced"},
            )
            assert raw.parse().choices[0].message.audio.data

            def trace_of_request() -> list[ReceivedSpan]:
                ours = [
                    s
                    for s in receiver.spans()
                    if str(s.attributes.get("omni.request_id", "")).startswith("traced-")
                ]
                tid = ours[0].trace_id if ours else None
                return [s for s in receiver.spans() if s.trace_id == tid]

            def complete() -> bool:
                services = {s.service for s in trace_of_request() if s.kind == SERVER}
                return services >= {"omni-gateway", *(f"omni-stage-{s}" for s in STAGES)}

            wait_for(complete, 30, "spans from the gateway and every stage replica")
            logs = {name: p.output() for name, p in d.stages.items()}
    finally:
        receiver.close()

    spans = trace_of_request()
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
