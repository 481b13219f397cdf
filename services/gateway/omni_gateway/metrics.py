"""Prometheus metrics of one gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from omni_pipeline.resource_metrics import ResourceGauges

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Migrations(Collector):
    """The service's count of requests run again on a fresh route, read when scraped."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "omni_gateway_migrations",
            "Requests run again on a fresh route, by outcome: moved (nothing sent yet), spliced (a "
            "stream continued), diverged (a stream's re-run differed from what was sent: failed)",
            labels=["outcome"],
        )
        counts = self.counts()
        for outcome in ("moved", "spliced", "diverged"):
            family.add_metric([outcome], counts.get(outcome, 0))
        yield family


class GatewayMetrics:
    def __init__(self, migrations: Callable[[], Mapping[str, int]] = dict) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_Migrations(migrations))
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
            "Request start to its first output of each kind (text: TTFT, audio: TTFA, image)",
            ["output"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "omni_gateway_errors",
            "Requests the pipeline failed after the gateway accepted them, by error code "
            "(stage_error, timeout, pipeline_saturated, stage_unavailable, ...)",
            ["code"],
            registry=r,
        )
        self.live_sessions = Gauge(
            "omni_gateway_realtime_sessions", "Live sessions open (WS /v1/realtime)", registry=r
        )
        self.live_responses = Counter(
            "omni_gateway_realtime_responses",
            "Live sessions' responses, by how they ended (completed, cancelled, incomplete, failed)",
            ["status"],
            registry=r,
        )
        self.barge_ins = Counter(
            "omni_gateway_realtime_barge_ins",
            "Responses cut short by the user (speech heard while they play, or the duplex barge_in)",
            registry=r,
        )
        self.resumes = Counter(
            "omni_gateway_realtime_resumes",
            "Full-duplex sessions resumed on a new socket after theirs dropped (session.resume)",
            registry=r,
        )
        self.video_jobs_running = Gauge(
            "omni_gateway_video_jobs_running", "Video jobs this gateway runs now (/v1/videos)", registry=r
        )
        self.video_jobs = Counter(
            "omni_gateway_video_jobs",
            "Video job runs this gateway ended, by outcome: completed, failed, requeued (the pipeline "
            "could not take it yet), given_back (the gateway stopped), lost (deleted, or taken over)",
            ["outcome"],
            registry=r,
        )
        self.video_job_seconds = Histogram(
            "omni_gateway_video_job_seconds",
            "A completed video job's run, from its claim to its files written",
            buckets=(*_BUCKETS, 600.0, 1800.0, 3600.0),
            registry=r,
        )
        self.batches_running = Gauge(
            "omni_gateway_batches_running", "Batches this gateway runs now (/v1/batches)", registry=r
        )
        self.batches = Counter(
            "omni_gateway_batches",
            "Batches this gateway ended, by status: completed, failed, cancelled, expired",
            ["status"],
            registry=r,
        )
        self.batch_lines = Counter(
            "omni_gateway_batch_lines",
            "Batch lines this gateway ran, by outcome: ok (a 2xx answer, in the output file), error (in "
            "the error file)",
            ["outcome"],
            registry=r,
        )
        self.batch_lines_running = Gauge(
            "omni_gateway_batch_lines_running", "Batch lines this gateway has in the pipeline now", registry=r
        )
        self.batch_lines_waiting = Gauge(
            "omni_gateway_batch_lines_waiting",
            "Lines of the batches this gateway runs that have not started yet",
            registry=r,
        )
        self.speech_to_audio = Histogram(
            "omni_gateway_realtime_speech_end_to_audio_seconds",
            "End of a user's turn (its commit, or VAD's speech_stopped) to its response's first audio",
            buckets=_BUCKETS,
            registry=r,
        )
