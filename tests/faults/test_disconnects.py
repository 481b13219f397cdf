"""Fault 4: 1000 streaming requests whose clients leave at random points.

Afterwards no request holds anything anywhere: every process's per-request gauges (tracked
requests, asyncio tasks, NATS subscriptions, shm segments, Mooncake keys) are back at their
idle values, nothing of ours is in use in /dev/shm or left in Mooncake, and no process's
resident memory grew by more than 5% over a warmed-up baseline.
"""

from __future__ import annotations

import asyncio
import collections
import random

import httpx
import pytest

from omni_cli.mooncaked import LocalMooncake
from tests.deployment import Deployment
from tests.faults.conftest import SHM_PREFIX
from tests.helpers import SOAK_TIMEOUT_S, shm_segments_in_use

REQUESTS = 1000
WARM_UP = 200
CONCURRENCY = 12
RSS_GROWTH = 1.05
SCANS = "master_remove_by_regex_requests_total"
"""How often mooncake_master searched its keys (a `cleanup`: every key matched against a pattern)."""


async def _storm(base: str, n: int, seed: int) -> collections.Counter[str]:
    """`n` streamed text+audio requests; each client reads a random number of events, then leaves."""
    rng = random.Random(seed)
    plans = [(rng.randint(8, 40), rng.randint(0, 30)) for _ in range(n)]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, max_tokens: int, leave_after: int) -> str:
        body = {
            "model": "faults",
            "messages": [{"role": "user", "content": "stream to me"}],
            "max_tokens": max_tokens,
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "pcm16"},
        }
        async with gate, client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {(await r.aread())[:200]!r}"
            events = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "finished"
                if line.startswith("data: "):
                    events += 1
                    if events > leave_after:
                        return "left"  # leaving the block closes the connection mid-stream
            return "cut short"

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return collections.Counter(await asyncio.gather(*(one(client, *p) for p in plans)))


@pytest.mark.timeout(SOAK_TIMEOUT_S)
def test_a_thousand_clients_that_walk_away(faults: Deployment, mooncake: LocalMooncake) -> None:
    idle = faults.gauges()
    warm = asyncio.run(_storm(faults.base, WARM_UP, seed=1))
    assert set(warm) <= {"finished", "left"}, warm
    faults.settle(idle)
    baseline = faults.rss()

    scans = mooncake.metric(SCANS)
    outcomes = asyncio.run(_storm(faults.base, REQUESTS, seed=2))
    assert set(outcomes) <= {"finished", "left"}, outcomes
    assert outcomes["left"] >= REQUESTS // 2 and outcomes["finished"] >= REQUESTS // 10, outcomes
    faults.settle(idle)
    assert shm_segments_in_use(SHM_PREFIX) == [] and mooncake.key_count() == 0
    # Each replica freed by name what it wrote; the store was searched only by the gateway's
    # backstop, at most once for each request that ended short, never by every replica.
    searched = mooncake.metric(SCANS) - scans
    print(f"store searches {searched} for {outcomes['left']} requests left")
    assert searched <= outcomes["left"], (searched, outcomes)

    after = faults.rss()
    growth = {p: after[p] / baseline[p] for p in baseline}
    print(f"outcomes {dict(outcomes)}; RSS growth { ({p: round(g, 4) for p, g in growth.items()}) }")
    assert all(g <= RSS_GROWTH for g in growth.values()), growth
