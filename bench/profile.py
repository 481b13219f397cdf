"""Where a served pipeline's time goes, stage by stage, over a stretch of load: read from each
replica's own /metrics before and after it (their counters and histogram sums), so a
benchmark can say what limited it.

Per stage, over the stretch:
- busy: the share of the wall time its compute thread worked (summed over its replicas: 2.0
  is two replicas always busy);
- batch: the mean number of requests' pieces per batched compute call;
- queue_ms: the mean wait of a request from admission to start;
- call_ms: the mean engine call (one window of inputs, its outputs' sending included);
- io_ms, serde_ms: connector put/get and (de)serialising time, per request.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

_READ = {
    "omni_engine_compute_seconds_total": "compute",
    "omni_engine_batches_total": "batches",
    "omni_engine_batched_items_total": "items",
    "omni_stage_queue_wait_seconds_sum": "queue_sum",
    "omni_stage_queue_wait_seconds_count": "queue_n",
    "omni_stage_engine_call_seconds_sum": "call_sum",
    "omni_stage_engine_call_seconds_count": "call_n",
    "omni_connector_seconds_sum": "io",
    "omni_wire_seconds_total": "serde",
}

Snapshot = dict[str, dict[str, float]]
T = TypeVar("T")


def snapshot(base: str) -> Snapshot:
    """stage -> the figures above as totals now, summed over the stage's replicas."""
    out: Snapshot = defaultdict(lambda: dict.fromkeys(_READ.values(), 0.0))
    for r in httpx.get(f"{base}/replicas", timeout=10).json()["replicas"]:
        text = httpx.get(f"http://127.0.0.1:{r['metrics_port']}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (key := _READ.get(sample.name)) is not None:
                    out[r["stage"]][key] += sample.value
    return dict(out)


def profile(before: Snapshot, after: Snapshot, wall_s: float, requests: int) -> dict[str, dict[str, Any]]:
    """What each stage did between two snapshots (module docstring)."""
    out = {}
    for stage, now in after.items():
        d = {k: v - before.get(stage, {}).get(k, 0.0) for k, v in now.items()}
        out[stage] = {
            "busy": round(d["compute"] / wall_s, 3),
            "batch": round(d["items"] / d["batches"], 2) if d["batches"] else 0.0,
            "queue_ms": round(1000 * d["queue_sum"] / d["queue_n"], 1) if d["queue_n"] else 0.0,
            "call_ms": round(1000 * d["call_sum"] / d["call_n"], 1) if d["call_n"] else 0.0,
            "io_ms": round(1000 * d["io"] / requests, 1),
            "serde_ms": round(1000 * d["serde"] / requests, 1),
        }
    return out


async def profiled(
    base: str, one: Callable[[], Awaitable[T]], concurrency: int, requests: int
) -> tuple[list[T], float, dict[str, dict[str, Any]]]:
    """`requests` calls of `one`, `concurrency` at a time (each client sends its next as soon as
    its last is answered), after one warm-up call: their results, the wall time, and where each
    stage's time went meanwhile."""
    await one()  # warm-up
    left = list(range(requests))
    done: list[T] = []

    async def client() -> None:
        while left:
            left.pop()
            done.append(await one())

    before = await asyncio.to_thread(snapshot, base)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return done, wall, profile(before, await asyncio.to_thread(snapshot, base), wall, len(done))
