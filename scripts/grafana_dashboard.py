"""Writes the chart's Grafana dashboard (charts/omni-pipeline/dashboards/omni-pipeline.json).

Generated, not hand-edited: one place says each panel's query. tests/integration/test_chart.py
checks the file equals what this prints, tests/e2e/test_observability.py that every metric it
queries is one a live gateway or stage exports. Run from the repository's root:
    python scripts/grafana_dashboard.py > charts/omni-pipeline/dashboards/omni-pipeline.json
"""

from __future__ import annotations

import json
from typing import Any

RATE = "$__rate_interval"
STAGES = 'pipeline=~"$pipeline", stage=~"$stage"'
GATEWAY = 'pipeline=~"$pipeline", component="gateway"'


def quantiles(metric: str, selector: str, by: str) -> list[tuple[str, str]]:
    """p50, p95 and p99 of a histogram, per `by`."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


# (title, unit, [(PromQL, legend)], description), in rows of two.
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    (
        "Gateway requests by status",
        "reqps",
        [(f"sum by (status) (rate(omni_gateway_requests_total{{{GATEWAY}}}[{RATE}]))", "{{status}}")],
        "Every answer the gateways gave, by HTTP status.",
    ),
    (
        "Gateway errors by code",
        "reqps",
        [(f"sum by (code) (rate(omni_gateway_errors_total{{{GATEWAY}}}[{RATE}]))", "{{code}}")],
        "Requests the pipeline failed after they were accepted: stage_error, timeout, "
        "pipeline_saturated (429), stage_unavailable (503), ...",
    ),
    (
        "Gateway latency",
        "s",
        quantiles("omni_gateway_request_seconds", GATEWAY, "component"),
        "Request start to its last byte.",
    ),
    (
        "Time to first output (TTFT, TTFA)",
        "s",
        quantiles("omni_gateway_time_to_first_output_seconds", GATEWAY, "output"),
        "Request start to its first text (TTFT), audio (TTFA) or image.",
    ),
    (
        "Stage throughput",
        "reqps",
        [
            (
                f'sum by (stage) (rate(omni_stage_requests_total{{{STAGES}, outcome="ok"}}[{RATE}]))',
                "{{stage}}",
            )
        ],
        "Requests each stage finished, all replicas.",
    ),
    (
        "Stage latency",
        "s",
        quantiles("omni_stage_request_seconds", STAGES, "stage"),
        "A request's start on a replica to its last segment.",
    ),
    (
        "Queue depth",
        "short",
        [(f"sum by (stage) (omni_stage_queued_requests{{{STAGES}}})", "{{stage}}")],
        "Requests waiting for a slot (maxInflight full): what to scale a stage on.",
    ),
    (
        "In flight",
        "short",
        [
            (f"sum by (stage) (omni_stage_inflight_requests{{{STAGES}}})", "{{stage}}"),
            (f"sum by (stage) (omni_stage_paused_requests{{{STAGES}}})", "{{stage}} paused for credit"),
        ],
        "Requests running in each stage; paused ones wait for a slow consumer.",
    ),
    (
        "Stage time to first segment",
        "s",
        quantiles("omni_stage_time_to_first_segment_seconds", STAGES, "stage"),
        "A request's start on a replica to its first segment out.",
    ),
    (
        "Time per segment",
        "s",
        quantiles("omni_stage_time_per_segment_seconds", STAGES, "stage"),
        "Between a request's segments on a stage (its streaming rate).",
    ),
    (
        "Stage failures and refusals",
        "reqps",
        [
            (
                f"sum by (stage, outcome) "
                f'(rate(omni_stage_requests_total{{{STAGES}, outcome!="ok"}}[{RATE}]))',
                "{{stage}} {{outcome}}",
            ),
            (
                f"sum by (stage, result) (rate(omni_stage_admissions_total{{{STAGES}, "
                f'result!~"run|queued"}}[{RATE}]))',
                "{{stage}} refused: {{result}}",
            ),
        ],
        "Requests that ended other than ok (aborted, timeout, invalid, error), and admissions refused.",
    ),
    (
        "Window triggers",
        "ops",
        [(f"sum by (stage) (rate(omni_stage_window_triggers_total{{{STAGES}}}[{RATE}]))", "{{stage}}")],
        "Engine calls started by an input window filling (or its last piece).",
    ),
    (
        "Connector bytes by edge",
        "Bps",
        [
            (
                f"sum by (stage, op, peer) (rate(omni_connector_bytes_total{{{STAGES}}}[{RATE}]))",
                "{{stage}} {{op}} ({{peer}})",
            )
        ],
        "Payload bytes each stage put for (or got from) the stage at the edge's other end.",
    ),
    (
        "Connector latency p95 by edge",
        "s",
        [
            (
                f"histogram_quantile(0.95, sum by (le, stage, op, peer) "
                f"(rate(omni_connector_seconds_bucket{{{STAGES}}}[{RATE}])))",
                "{{stage}} {{op}} ({{peer}})",
            )
        ],
        "One put or get, 95th percentile.",
    ),
    (
        "Credit wait",
        "percentunit",
        [
            (
                f"sum by (stage, consumer) (rate(omni_stage_credit_wait_seconds_total{{{STAGES}}}[{RATE}]))",
                "{{stage}} -> {{consumer}}",
            )
        ],
        "Share of time requests on a stage spent paused for a slow consumer (backpressure).",
    ),
    (
        "Memory",
        "bytes",
        [
            ('sum by (pod) (process_resident_memory_bytes{pipeline=~"$pipeline"})', "{{pod}} resident"),
            (
                f"sum by (stage, device) (omni_engine_weight_bytes{{{STAGES}}})",
                "{{stage}} weights on {{device}}",
            ),
        ],
        "Resident memory of every pod, and the weights each stage's engines hold by device.",
    ),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]], description: str) -> dict[str, Any]:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
            for j, (expr, legend) in enumerate(targets)
        ],
    }


def variable(name: str, query: str, include_all: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "refresh": 2,
        "includeAll": include_all,
        "multi": include_all,
        "current": {"text": "All", "value": "$__all"} if include_all else {},
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "omni-pipeline",
        "title": "omni-pipeline",
        "description": "Per-stage throughput, latency, queues, errors and data movement of omni-pipeline "
        "pipelines (docs/observability.md names every metric).",
        "tags": ["omni-pipeline"],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
                variable("pipeline", "label_values(omni_gateway_requests_total, pipeline)"),
                variable("stage", 'label_values(omni_stage_requests_total{pipeline=~"$pipeline"}, stage)'),
            ]
        },
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=2))
