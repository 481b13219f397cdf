"""Closed-loop load against a gateway: `concurrency` clients, each sending its next request as
soon as its last one is answered, over one HTTP connection pool.

aiohttp, not httpx: on two cores the load generator shares the CPU with what it measures, and
httpx spends about 2 ms of CPU per request, four times aiohttp's."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass
class Load:
    latencies_s: list[float]
    wall_s: float

    @property
    def per_s(self) -> float:
        return len(self.latencies_s) / self.wall_s


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "user", "content": content}], **extra}


async def closed_loop(base: str, body: dict[str, Any], requests: int, concurrency: int) -> Load:
    """Send `requests` chat completions, `concurrency` at a time; every one must succeed."""
    ids = itertools.count()
    latencies: list[float] = []
    url = f"{base}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def worker() -> None:
            while next(ids) < requests:
                t = time.perf_counter()
                async with session.post(url, json=body) as r:
                    text = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"gateway answered {r.status}: {text[:500]!r}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Load(latencies, time.perf_counter() - t0)
