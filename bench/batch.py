"""batch: the Batch API on the tiny omni pipeline (examples/tiny-omni.yaml), against the same
requests sent online, in the same run, on the same cores.

Each request: a chat completion with text and audio out (`modalities: ["text", "audio"]`, wav),
32 thinker tokens. The pipeline's stages each admit 4 requests at once (`maxInflight`), and the
gateway runs that many batch lines at once (`gateway.batches.concurrency: 4`).

- online: LINES requests, 4 clients at once (the concurrency the replicas admit), each sending
  its next as soon as its last is answered: requests per second.
- batch: the same LINES requests as one batch (`files.create`, `batches.create`), from its
  creation to `completed`: lines per second. `batch_vs_online` is the median of the one over
  the median of the other (goal >= 0.9: running work as a batch costs little).
- live TTFP: 2 clients sending streamed chat completions (text and audio) one after another,
  their median time to the first audio chunk, with no batch running and then while a batch of
  LINES runs. `live_ttfp_during_batch_vs_idle` is the median of the one over the median of the
  other (goal <= 1.3: live users come first: every replica starts their requests before the
  batch's waiting lines, and each live request keeps `livePriority` lines from starting).
Each of the four is measured ROUNDS times, the rounds interleaved.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any, Final

import aiohttp
import httpx
import yaml

from bench.common import bars, figure, machine, median, parser, report, rounds, save
from bench.load import chat
from bench.omni_stream import streamed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
LINES: Final = 200
ROUNDS: Final = 3
LIVE: Final = 20
CONCURRENCY: Final = 4
TOKENS: Final = 32


def body(i: int) -> dict[str, Any]:
    return chat(
        f"Tell me about the sea, please ({i}).",
        max_tokens=TOKENS,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )


def spec() -> dict[str, Any]:
    s = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())["spec"])
    s["servedModelName"] = "bench"
    s["gateway"]["batches"] = {"concurrency": CONCURRENCY, "store": "sqlite"}
    return s  # type: ignore[no-any-return]


async def online(base: str, n: int) -> float:
    """Requests per second: `n` requests, CONCURRENCY clients one after another."""
    left = list(range(n))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> None:
            while left:
                i = left.pop()
                async with session.post(f"{base}/v1/chat/completions", json=body(i)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"gateway answered {r.status}: {(await r.read())[:300]!r}")
                    await r.read()

        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        return n / (time.perf_counter() - t)


def start_batch(client: httpx.Client, n: int) -> tuple[str, float]:
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
        for i in range(n)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.post(
        "/v1/files", files={"file": ("lines.jsonl", data)}, data={"purpose": "batch"}
    ).raise_for_status()
    asked = {"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    t = time.perf_counter()
    return client.post("/v1/batches", json=asked).raise_for_status().json()["id"], t


def batch_done(client: httpx.Client, batch_id: str) -> dict[str, Any] | None:
    b = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
    if b["status"] in ("failed", "cancelled", "expired"):
        raise RuntimeError(f"batch {batch_id} ended {b['status']}: {b.get('errors')}")
    return b if b["status"] == "completed" else None


async def batch_rate(base: str, n: int) -> float:
    """Lines per second: one batch of `n`, from its creation to `completed`."""
    with httpx.Client(base_url=base, timeout=60) as client:
        batch_id, t = start_batch(client, n)
        while (b := batch_done(client, batch_id)) is None:
            await asyncio.sleep(0.05)
        assert b["request_counts"]["completed"] == n, b
        return n / (time.perf_counter() - t)


async def live_ttfp(base: str, n: int) -> float:
    """Median time to first audio of `n` streamed requests, 2 clients one after another."""
    left = list(range(n))
    ttfp: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> None:
            while left:
                i = left.pop()
                asked = {**body(i), "stream": True, "audio": {"voice": "alloy", "format": "pcm16"}}
                ttfp.append((await streamed(session, base, asked))["audio_ttfp"])

        await asyncio.gather(client(), client())
    return median(ttfp)


async def live_during_batch(base: str, n_live: int, n_lines: int) -> float:
    """Live TTFP while a batch of `n_lines` runs (the batch started first, and running throughout)."""
    with httpx.Client(base_url=base, timeout=60) as client:
        batch_id, _ = start_batch(client, n_lines)
        while client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] < CONCURRENCY:
            await asyncio.sleep(0.05)  # the batch's lines fill the replicas
        ttfp = await live_ttfp(base, n_live)
        still = client.get(f"/v1/batches/{batch_id}").json()
        if still["status"] == "completed":
            raise RuntimeError("the batch ended before the live requests did: make it longer")
        client.post(f"/v1/batches/{batch_id}/cancel")
        while client.get(f"/v1/batches/{batch_id}").json()["status"] != "cancelled":
            await asyncio.sleep(0.05)
        return ttfp


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (a, b) = figure(2)
    runs = result["runs"]
    bars(
        a, ["requests/s"], {k: [runs[k]] for k in ("online_per_s", "batch_per_s")}, "per second", "throughput"
    )
    bars(
        b,
        ["TTFP"],
        {k: [runs[k]] for k in ("live_ttfp_idle_ms", "live_ttfp_during_batch_ms")},
        "ms",
        "live TTFP",
    )
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    lines, live = (16, 4) if args.quick else (LINES, LIVE)
    with demo_models() as cwd, served("bench", spec(), cwd=cwd) as base:
        asyncio.run(online(base, CONCURRENCY))  # warm-up
        samples: dict[str, list[float]] = {k: [] for k in ("online_per_s", "batch_per_s", "idle", "during")}
        during = lines * 3 if args.quick else lines  # a batch that outlasts the live requests
        for _ in range(rounds(ROUNDS, args)):  # interleaved: a slow minute of the machine hits both sides
            samples["online_per_s"].append(asyncio.run(online(base, lines)))
            samples["batch_per_s"].append(asyncio.run(batch_rate(base, lines)))
            samples["idle"].append(asyncio.run(live_ttfp(base, live)) * 1000)
            samples["during"].append(asyncio.run(live_during_batch(base, live, during)) * 1000)
        runs = {k: median(samples[k]) for k in ("online_per_s", "batch_per_s")}
        runs["live_ttfp_idle_ms"] = median(samples["idle"])
        runs["live_ttfp_during_batch_ms"] = median(samples["during"])
    runs = {k: round(v, 3) for k, v in runs.items()}
    ratios = {
        "batch_vs_online": round(runs["batch_per_s"] / runs["online_per_s"], 3),
        "live_ttfp_during_batch_vs_idle": round(
            runs["live_ttfp_during_batch_ms"] / runs["live_ttfp_idle_ms"], 3
        ),
    }
    result = {"benchmark": "batch", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [(k, str(v)) for k, v in runs.items()] + [(k, str(v)) for k, v in ratios.items()]
    report("batch", rows, result, args, plot)


if __name__ == "__main__":
    main()
