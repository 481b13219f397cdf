"""Prometheus metrics of the operator itself: how its reconciles go, and the pipelines it serves
by condition (from the statuses it last wrote), on a registry of its own."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _PipelinesByCondition(Collector):
    def __init__(self, statuses: Callable[[], Iterable[list[dict[str, Any]]]]) -> None:
        self.statuses = statuses

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "omni_operator_pipelines",
            "Pipelines this operator serves, by condition (Ready, Progressing, Degraded, InvalidSpec) "
            "and its status (True, False, Unknown), as it last reported them",
            labels=["condition", "status"],
        )
        counts = collections.Counter(
            (c["type"], c["status"]) for conditions in self.statuses() for c in conditions
        )
        for (condition, status), n in sorted(counts.items()):
            family.add_metric([condition, status], n)
        yield family


class OperatorMetrics:
    def __init__(self, statuses: Callable[[], Iterable[list[dict[str, Any]]]]) -> None:
        self.registry = r = CollectorRegistry()
        self.reconciles = Counter(
            "omni_operator_reconciles",
            "Reconciles of a pipeline, by result: applied, invalid_spec (the spec cannot run), "
            "apply_failed (the API server refused a child), error",
            ["result"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "omni_operator_reconcile_seconds",
            "One reconcile: read, render, apply, prune, report",
            buckets=_SECONDS,
            registry=r,
        )
        r.register(_PipelinesByCondition(statuses))
