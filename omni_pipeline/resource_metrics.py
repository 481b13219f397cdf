"""Gauges of what a process holds for its requests, on its own /metrics.

Every per-request resource has a count here, so a leak is a number that does not come back
down after the load that raised it (the fault tests assert exactly that). The gateway and the
stage replicas both export these; prometheus_client's ProcessCollector adds resident memory
and open file descriptors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

from nats.aio.client import Client as NatsClient
from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

from omni_pipeline.connectors import OmniConnector
from omni_pipeline.connectors.mooncake import MooncakeConnector
from omni_pipeline.connectors.shm import ShmConnector

COUNT_WAIT_S: Final = 1.0
"""How long a /metrics scrape waits for the connectors' counts before it reports the last ones."""


def nats_subscriptions(nc: NatsClient | None) -> int:
    """Subscriptions the client holds (nats-py keeps no public count; `_subs` is its table)."""
    return len(getattr(nc, "_subs", ())) if nc is not None else 0


class ResourceGauges:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.process = ProcessCollector(registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, labels.keys(), registry=registry)
            return g.labels(**labels) if labels else g

        self.tasks = gauge("omni_asyncio_tasks", "asyncio tasks alive in this process's event loop")
        self.subscriptions = gauge("omni_nats_subscriptions", "NATS subscriptions this process holds")
        self.shm_segments = gauge(
            "omni_shm_segments",
            "Shared-memory segments of this deployment that requests hold (idle pooled ones not counted)",
        )
        self.mooncake_keys = gauge(
            "omni_mooncake_keys", "Mooncake keys this process put that are still in the store"
        )
        self.pool_bytes = gauge(
            "omni_connector_pool_bytes",
            "Memory connectors keep warm for reuse: shm segments this process owns, idle mooncake buffers",
        )

    def resident_bytes(self) -> int:
        """The process's resident memory now (0 where the platform does not tell)."""
        for family in self.process.collect():
            if family.name == "process_resident_memory_bytes":
                return int(family.samples[0].value)
        return 0

    def refresh(self, nc: NatsClient | None) -> None:
        """What the event loop holds; call on its thread (before a scrape: it asks nobody)."""
        self.tasks.set(len(asyncio.all_tasks()))
        self.subscriptions.set(nats_subscriptions(nc))

    def count_connectors(self, connectors: Iterable[OmniConnector]) -> None:
        """What the connectors hold. Counting may wait on a backend (Mooncake's master): run it
        off the loop (`OffLoop.within`), and a scrape that cannot wait reads the last count."""
        conns = list(connectors)
        self.shm_segments.set(sum(c.live_objects() for c in conns if isinstance(c, ShmConnector)))
        self.mooncake_keys.set(sum(c.live_objects() for c in conns if isinstance(c, MooncakeConnector)))
        self.pool_bytes.set(sum(c.pooled_bytes() for c in conns))
