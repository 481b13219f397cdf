"""Prometheus metrics of one stage replica (seed 000, section 12), on a registry of its own."""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_pipeline.resource_metrics import ResourceGauges

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class StageMetrics:
    def __init__(self, stage: str, replica: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"stage": stage, "replica": replica}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels.keys(), registry=r).labels(**labels)

        self.queued = gauge("omni_stage_queued_requests", "Requests waiting for a slot")
        self.inflight = gauge("omni_stage_inflight_requests", "Requests running or paused")
        self.paused = gauge(
            "omni_stage_paused_requests", "Running requests paused until a consumer returns credit"
        )
        self.unread_bytes = gauge(
            "omni_stage_unread_bytes",
            "Bytes of output put on connectors and not yet read by the consumer stages",
        )
        self.credit_accounts = gauge(
            "omni_stage_credit_accounts", "Requests whose output to consumer stages is not all read yet"
        )
        self.credit_wait_seconds = Counter(
            "omni_stage_credit_wait_seconds",
            "Time requests spent paused for credit, by consumer stage (the edge)",
            [*labels.keys(), "consumer"],
            registry=r,
        )
        self.tracked = gauge("omni_stage_tracked_requests", "Per-request states held (queued, running)")
        self.engine_requests = gauge(
            "omni_engine_active_requests", "Requests the engine itself holds (vLLM, diffusers)"
        )
        self.engine_steps = Counter(
            "omni_engine_steps",
            "Loop steps the engine has run (diffusion steps and decodes)",
            labels.keys(),
            registry=r,
        ).labels(**labels)
        self._engine_steps_seen = 0
        self.slot_steps = Counter(
            "omni_engine_slot_steps",
            "Decode steps on a slot table, by how they ran: replayed (a CUDA graph), fixed (at a "
            "bucket's shapes, launched), own (the table's own shapes: no bucket or span held them)",
            [*labels.keys(), "ran"],
            registry=r,
        )
        # Where a replica's time goes (omni bench qwen-omni reads them): its compute thread's
        # busy seconds, its batched calls and the requests in them, the wait from admission to
        # start, each engine call (a window), and (de)serialising frames.
        self.compute_seconds = Counter(
            "omni_engine_compute_seconds", "Seconds the compute thread has worked", labels.keys(), registry=r
        ).labels(**labels)
        self.batches = Counter(
            "omni_engine_batches", "Batched compute calls run", labels.keys(), registry=r
        ).labels(**labels)
        self.batched_items = Counter(
            "omni_engine_batched_items", "Requests' pieces in those calls", labels.keys(), registry=r
        ).labels(**labels)
        self.queue_wait = Histogram(
            "omni_stage_queue_wait_seconds",
            "Admission to start, per request",
            labels.keys(),
            buckets=_LATENCY,
            registry=r,
        ).labels(**labels)
        self.engine_call = Histogram(
            "omni_stage_engine_call_seconds",
            "One engine call (a window of inputs, its outputs' sending included)",
            labels.keys(),
            buckets=_LATENCY,
            registry=r,
        ).labels(**labels)
        self.wire_seconds = Counter(
            "omni_wire_seconds",
            "Seconds encoding and decoding frames, by op",
            [*labels.keys(), "op"],
            registry=r,
        )
        self._totals: dict[str, float] = {}
        self.requests = Counter(
            "omni_stage_requests", "Requests ended, by outcome", [*labels.keys(), "outcome"], registry=r
        )
        self.admissions = Counter(
            "omni_stage_admissions",
            "Requests offered to the replica, by result: run, queued, or why refused (full, draining, ...)",
            [*labels.keys(), "result"],
            registry=r,
        )
        self.window_triggers = Counter(
            "omni_stage_window_triggers", "Engine calls triggered by input windows", labels.keys(), registry=r
        ).labels(**labels)
        self.segments = Counter("omni_stage_segments", "Segments flushed", labels.keys(), registry=r).labels(
            **labels
        )
        # By edge: `peer` is the stage at the edge's other end (`request` for the client's input
        # read by a source stage, `gateway` for final outputs).
        self.connector_bytes = Counter(
            "omni_connector_bytes",
            "Payload bytes through connectors, by connector, op (put, get) and the edge's other stage",
            [*labels.keys(), "connector", "op", "peer"],
            registry=r,
        )
        self.connector_seconds = Histogram(
            "omni_connector_seconds",
            "Connector put/get latency, by connector, op and the edge's other stage",
            [*labels.keys(), "connector", "op", "peer"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "omni_stage_time_to_first_segment_seconds",
            "Request start to first segment",
            labels.keys(),
            buckets=_LATENCY,
            registry=r,
        ).labels(**labels)
        self.time_per_segment = Histogram(
            "omni_stage_time_per_segment_seconds",
            "Time between segments",
            labels.keys(),
            buckets=_LATENCY,
            registry=r,
        ).labels(**labels)
        self.latency = Histogram(
            "omni_stage_request_seconds",
            "Request start to last segment",
            labels.keys(),
            buckets=_LATENCY,
            registry=r,
        ).labels(**labels)
        self.sleep_level = gauge(
            "omni_stage_sleep_level", "The level the replica sleeps at (POST /v1/omni/sleep); -1 while awake"
        )
        self.weight_bytes = Gauge(
            "omni_engine_weight_bytes",
            "Bytes of weights the engine holds, by device type (what sleep frees)",
            [*labels.keys(), "device"],
            registry=r,
        )
        self.prompt_caches = gauge(
            "omni_engine_prompt_caches", "Conversations' sequences kept between requests (prompt_cache_key)"
        )
        self.prompt_cache_reused = Counter(
            "omni_engine_prompt_cache_reused_tokens",
            "Prompt tokens a kept sequence held, not computed again",
            labels.keys(),
            registry=r,
        ).labels(**labels)
        self.audio_ahead = gauge(
            "omni_engine_audio_ahead_sessions", "Live sessions whose audio is encoded as it arrives"
        )
        self.audio_windows = Counter(
            "omni_engine_audio_windows",
            "Windows of a request's audio the encoder ran: ahead, as the audio arrived, or late, "
            "when the request came",
            [*labels.keys(), "encoded"],
            registry=r,
        )
        self.resources = ResourceGauges(r, labels)
        self._labels = labels

    def weights_held(self, by_device: dict[str, int]) -> None:
        for device in ("cpu", "cuda", *by_device):
            self.weight_bytes.labels(**self._labels, device=device).set(by_device.get(device, 0))

    def audio_windows_encoded(self, ahead: int, late: int) -> None:
        for when, total in (("ahead", ahead), ("late", late)):
            self.follow(self.audio_windows.labels(**self._labels, encoded=when), total, f"audio-{when}")

    def follow(self, counter: Any, total: float, key: str) -> None:
        """Advance `counter` to a total the process keeps itself (never back)."""
        seen = self._totals.get(key, 0.0)
        if total > seen:
            counter.inc(total - seen)
            self._totals[key] = total

    def time_spent(
        self, compute_s: float | None, batch_sizes: collections.Counter[int] | None, wire: dict[str, float]
    ) -> None:
        if compute_s is not None:
            self.follow(self.compute_seconds, compute_s, "compute")
        if batch_sizes is not None:
            self.follow(self.batches, sum(batch_sizes.values()), "batches")
            self.follow(self.batched_items, sum(n * k for n, k in batch_sizes.items()), "items")
        for op, seconds in wire.items():
            self.follow(self.wire_seconds.labels(**self._labels, op=op), seconds, f"wire-{op}")

    def slot_steps_ran(self, ran: collections.Counter[str]) -> None:
        for how in ("replayed", "fixed", "own"):
            self.follow(self.slot_steps.labels(**self._labels, ran=how), ran[how], f"slot-steps-{how}")

    def engine_steps_reached(self, total: int) -> None:
        """The engine counts its own steps; the counter follows its total."""
        self.engine_steps.inc(max(0, total - self._engine_steps_seen))
        self._engine_steps_seen = max(total, self._engine_steps_seen)

    def admission(self, result: str) -> None:
        self.admissions.labels(**self._labels, result=result).inc()

    def outcome(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def credit_wait(self, consumer: str, seconds: float) -> None:
        self.credit_wait_seconds.labels(**self._labels, consumer=consumer).inc(seconds)

    def connector(self, connector: str, op: str, peer: str, nbytes: int, seconds: float) -> None:
        edge = {**self._labels, "connector": connector, "op": op, "peer": peer}
        self.connector_bytes.labels(**edge).inc(nbytes)
        self.connector_seconds.labels(**edge).observe(seconds)
