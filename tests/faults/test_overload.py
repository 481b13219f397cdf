"""Fault 5, overload at 10x capacity, and fault 6, poisoned inputs among good ones.

Overload: the gateway answers 429 with Retry-After once every replica of a needed stage is
full, never a 5xx; memory stays bounded; nothing crashes; the backlog drains and the
pipeline serves normally afterwards. Poison: an exception in one stage for one request fails
that request only, while the requests around it succeed.
"""

from __future__ import annotations

import asyncio
import collections

import httpx

from omni_cli.mooncaked import LocalMooncake
from tests.deployment import Deployment, ask
from tests.faults.conftest import SHM_PREFIX
from tests.helpers import shm_segments_in_use

CAPACITY = 16  # per stage: maxInflight 8 + maxQueued 8, one replica (synthetic-faults.yaml)
GATEWAY_RSS_GROWTH = 1.10


async def _burst(base: str, contents: list[str]) -> list[httpx.Response]:
    """All at once: one text+audio request per content, each on its own connection."""
    limits = httpx.Limits(max_connections=len(contents), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def one(content: str) -> httpx.Response:
            body = {
                "model": "faults",
                "messages": [{"role": "user", "content": content}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "alloy", "format": "wav"},
            }
            return await client.post("/v1/chat/completions", json=body)

        return list(await asyncio.gather(*(one(c) for c in contents)))


def test_overload_at_ten_times_capacity(faults: Deployment, mooncake: LocalMooncake) -> None:
    idle = faults.gauges()
    asyncio.run(_burst(faults.base, ["warm"] * CAPACITY))  # the gateway's buffers at full load
    faults.settle(idle)
    rss_before = faults.rss()["gateway-0"]

    responses = asyncio.run(_burst(faults.base, [f"burst {i}" for i in range(10 * CAPACITY)]))
    statuses = collections.Counter(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses[200] >= CAPACITY, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert all(p.proc.poll() is None for p in [*faults.stages.values(), faults.gateways[0][0]])

    faults.settle(idle)  # the backlog drains
    assert shm_segments_in_use(SHM_PREFIX) == [] and mooncake.key_count() == 0
    assert [ask(faults.base, f"after {i}") for i in range(3)] == ["ok"] * 3
    growth = faults.rss()["gateway-0"] / rss_before
    print(f"statuses {dict(statuses)}; gateway RSS x{growth:.3f}")
    assert growth <= GATEWAY_RSS_GROWTH


def test_poisoned_inputs_fail_only_themselves(faults: Deployment) -> None:
    idle = faults.gauges()
    contents = ["POISON" if i % 4 == 0 else f"good {i}" for i in range(CAPACITY)]
    responses = asyncio.run(_burst(faults.base, contents))
    for content, r in zip(contents, responses, strict=True):
        if content == "POISON":
            assert r.status_code == 500, r.text
            assert "stage 'thinker'" in r.json()["error"]["message"] and "poisoned" in r.text
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["audio"]["data"]
    faults.settle(idle)
