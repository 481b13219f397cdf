"""hop: the latency one stage adds to a message, against a raw NATS request/reply.

Ours: a real `omni stage` process (synthetic engine, no compute) relays one segment with an
inline payload: this process publishes the SegmentMsg to the stage's inbox and times until the
stage's FinalMsg arrives in its own inbox. That is two trips through nats-server and one
process turning the message around, as a raw request/reply is: a responder process that echoes
the same bytes back. The request's admission (StageRequest, Admitted) happens before the clock
starts: it is per request, not per hop. The two paths take turns, after a warm-up.

Ratio: p50_vs_raw_nats = our p50 / raw p50 (goal <= 2.0); p99 as well.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import nats
import torch

from bench.common import bars, figure, machine, parser, percentile, report, rounds, save
from bench.direct import DirectClient
from bench.procs import stage
from omni_cli.natsd import EmbeddedNats
from omni_pipeline.connectors import InlineConnector
from omni_pipeline.control import SegmentMsg, pack
from omni_pipeline.settings import ConnectorSpec

ROUNDS = 1000
WARMUP = 50
ECHO = "bench.echo"
SPEC: dict[str, Any] = {
    "servedModelName": "hop",
    "connectors": {"default": {"kind": "inline"}},
    "stages": [
        {"name": "source", "engine": {"kind": "synthetic"}, "inputs": [{"from": "request"}], "replicas": 0},
        {
            "name": "relay",
            "engine": {"kind": "synthetic"},
            "inputs": [{"from": "source", "window": -1}],
            "finalOutput": "text",
            "maxInflight": 4,
        },
    ],
}


def _echo(url: str, ready: Any) -> None:
    async def serve() -> None:
        nc = await nats.connect(url)

        async def reply(msg: Any) -> None:
            await msg.respond(msg.data)

        await nc.subscribe(ECHO, cb=reply)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(serve())


async def ours(client: DirectClient, connector: InlineConnector) -> tuple[float, int]:
    """One segment through the relay: this process is its upstream stage and its gateway."""
    ctx = client.context({"source": "0", "relay": "0"})
    await client.admit("relay", ctx, None)
    _, _, handle = connector.put("source", "relay", ctx.request_id, {"token_ids": torch.tensor([7])})
    msg = pack(SegmentMsg(ctx, "source", 0, True, 1, handle))
    t = time.perf_counter()
    await client.nc.publish(client.subjects.stage_inbox("relay", "0"), msg)
    await client.finished(ctx)
    return time.perf_counter() - t, len(msg)


async def raw(nc: Any, nbytes: int) -> float:
    t = time.perf_counter()
    await nc.request(ECHO, b"x" * nbytes, timeout=10)
    return time.perf_counter() - t


async def measure(url: str, n: int) -> dict[str, list[float]]:
    nc = await nats.connect(url)
    try:
        client = DirectClient(nc, "hop")
        await client.start()
        connector = InlineConnector("default", ConnectorSpec(kind="inline"))  # type: ignore[arg-type]
        times: dict[str, list[float]] = {"ours": [], "raw_nats": []}
        for i in range(WARMUP + n):
            dt, nbytes = await ours(client, connector)
            baseline = await raw(nc, nbytes)
            if i >= WARMUP:
                times["ours"].append(dt)
                times["raw_nats"].append(baseline)
        return times
    finally:
        await nc.close()


def plot(result: dict[str, Any], path: Any) -> None:
    fig, ax = figure()
    labels = ["p50", "p90", "p99"]
    series = {p: [result["latency_ms"][p][k] for k in labels] for p in ("raw_nats", "ours")}
    bars(ax, labels, series, "ms", "one stage hop (inline payload) vs raw NATS request/reply")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    server = EmbeddedNats()
    ready = mp.get_context("spawn").Event()
    echo = mp.get_context("spawn").Process(target=_echo, args=(server.url, ready), daemon=True)
    echo.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("echo responder did not start")
        with stage("hop", SPEC, "relay", server.url):
            times = asyncio.run(measure(server.url, rounds(ROUNDS, args)))
    finally:
        echo.terminate()
        echo.join(10)
        server.stop()
    lat = {
        p: {k: round(percentile(ts, q) * 1000, 3) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}
        for p, ts in times.items()
    }
    result = {
        "benchmark": "hop",
        "machine": machine(),
        "rounds": rounds(ROUNDS, args),
        "latency_ms": lat,
        "ratios": {
            "p50_vs_raw_nats": round(lat["ours"]["p50"] / lat["raw_nats"]["p50"], 2),
            "p99_vs_raw_nats": round(lat["ours"]["p99"] / lat["raw_nats"]["p99"], 2),
        },
    }
    rows = [(f"{p} ms", "  ".join(f"{k}={v}" for k, v in lat[p].items())) for p in lat]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("hop", rows, result, args, plot)


if __name__ == "__main__":
    main()
