"""Closed-loop load against a gateway: `concurrency` clients, each sending its next request as
soon as its last one is answered, over one HTTP connection pool."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import httpx


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
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"{base}/v1", timeout=120, limits=limits) as client:

        async def worker() -> None:
            while next(ids) < requests:
                t = time.perf_counter()
                r = await client.post("/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"gateway answered {r.status_code}: {r.text[:500]}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Load(latencies, time.perf_counter() - t0)
