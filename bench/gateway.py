"""gateway: the latency and throughput the OpenAI-compatible gateway adds to a request.

`omni serve` of a one-stage synthetic pipeline of negligible cost (one token, no sleep;
maxInflight 64). At each concurrency (1, 16, 64), closed-loop clients send non-streamed chat
completions through the gateway over HTTP; the baseline sends the same requests straight to
the stage over NATS, as the gateway itself does (StageRequest, Admitted, FinalMsg), from this
process. Both use the same nats-server and stage, in turns, after a warm-up.

added_latency_p50_ms = gateway p50 - direct p50 at concurrency 1: what HTTP, OpenAI request and
response handling, routing and the gateway's own NATS hop cost. Also p99, and requests/s at
each concurrency for both paths.

Tracing: then the same pipeline again with `observability.otlpEndpoint` set, every request
traced (the SDK's default sampler) and its spans sent to an OTLP/HTTP endpoint in this process
that counts what it receives; its gateway path at each concurrency. traced_vs_untraced_p50 =
its p50 / the untraced gateway's at concurrency 1; tracing_cost_p50_ms, the difference. One
after the other, not side by side: a traced pipeline exports in the background (every 5 s),
which would land on the other's turns.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats

from bench.common import bars, figure, machine, parser, percentile, report, rounds, save
from bench.direct import DirectClient
from bench.load import Load, chat, closed_loop
from bench.otlp import OtlpReceiver
from bench.procs import served
from omni_cli.natsd import EmbeddedNats
from omni_pipeline.control import RequestInputs

CONCURRENCY = (1, 16, 64)
REQUESTS = {1: 400, 16: 1200, 64: 2000}
SPEC: dict[str, Any] = {
    "servedModelName": "bench",
    "gateway": {"requestTimeoutS": 60},
    "stages": [
        {
            "name": "echo",
            "engine": {"kind": "synthetic", "args": {"unitsPerCall": 1}},
            "inputs": [{"from": "request"}],
            "finalOutput": "text",
            "maxInflight": 64,
            "maxQueued": 256,
        }
    ],
}
INPUTS = RequestInputs(["text"], messages=[{"role": "user", "content": "hi"}])


async def direct_loop(client: DirectClient, requests: int, concurrency: int) -> Load:
    latencies: list[float] = []
    left = iter(range(requests))

    async def worker() -> None:
        for _ in left:
            t = time.perf_counter()
            ctx = client.context({"echo": "0"})
            await client.admit("echo", ctx, INPUTS)
            await client.finished(ctx)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Load(latencies, time.perf_counter() - t0)


def summary(load: Load) -> dict[str, float]:
    ms = [x * 1000 for x in load.latencies_s]
    return {
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "per_s": round(load.per_s, 1),
    }


Paths = dict[str, dict[str, dict[str, float]]]
"""path -> concurrency -> p50_ms, p99_ms, per_s"""


async def measure(base: str, nats_url: str | None, requests: dict[int, int], gateway: str) -> Paths:
    """The `gateway` path at each concurrency, and the direct one too when given NATS."""
    body = chat("hi")
    await closed_loop(base, body, 100, 4)  # warm-up
    out: Paths = {gateway: {}}
    if nats_url is None:
        for c in CONCURRENCY:
            out[gateway][str(c)] = summary(await closed_loop(base, body, requests[c], c))
        return out
    nc = await nats.connect(nats_url)
    try:
        client = DirectClient(nc, "bench")
        await client.start()
        await direct_loop(client, 100, 4)
        out["direct"] = {}
        for c in CONCURRENCY:
            out[gateway][str(c)] = summary(await closed_loop(base, body, requests[c], c))
            out["direct"][str(c)] = summary(await direct_loop(client, requests[c], c))
        return out
    finally:
        await nc.close()


def plot(result: dict[str, Any], path: Any) -> None:
    fig, (lat, thr) = figure(ncols=2)
    cs = [str(c) for c in CONCURRENCY]
    paths = result["paths"]
    groups = [f"c={c}" for c in cs]
    shown = ("direct", "gateway", "gateway_traced")
    latency = {f"{p} p50": [paths[p][c]["p50_ms"] for c in cs] for p in shown}
    bars(lat, groups, latency, "latency p50, ms", "gateway (traced or not) vs straight to the stage")
    bars(thr, groups, {p: [paths[p][c]["per_s"] for c in cs] for p in shown}, "requests / s")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    requests = {c: rounds(n, args) * c if args.quick else n for c, n in REQUESTS.items()}
    server = EmbeddedNats()
    receiver = OtlpReceiver(decode=False)  # a collector's receiving end, without its work
    traced_spec = {**SPEC, "observability": {"otlpEndpoint": receiver.url}}
    try:
        with served("bench", SPEC, nats_url=server.url) as base:
            paths = asyncio.run(measure(base, server.url, requests, "gateway"))
        with served("bench", traced_spec, nats_url=server.url) as base:
            paths |= asyncio.run(measure(base, None, requests, "gateway_traced"))
    finally:
        server.stop()
        receiver.close()
    gw, traced_gw, direct = paths["gateway"], paths["gateway_traced"], paths["direct"]
    if not receiver.exports:
        raise SystemExit("gateway: the traced pipeline exported no spans")
    result = {
        "benchmark": "gateway",
        "machine": machine(),
        "requests": requests,
        "paths": paths,
        "otlp_exports": receiver.exports,
        "otlp_bytes": receiver.bytes,
        "ratios": {
            "added_latency_p50_ms": round(gw["1"]["p50_ms"] - direct["1"]["p50_ms"], 3),
            "added_latency_p99_ms": round(gw["1"]["p99_ms"] - direct["1"]["p99_ms"], 3),
            "throughput_64_vs_direct": round(gw["64"]["per_s"] / direct["64"]["per_s"], 3),
            "tracing_cost_p50_ms": round(traced_gw["1"]["p50_ms"] - gw["1"]["p50_ms"], 3),
            "traced_vs_untraced_p50": round(traced_gw["1"]["p50_ms"] / gw["1"]["p50_ms"], 3),
            "traced_vs_untraced_throughput_64": round(traced_gw["64"]["per_s"] / gw["64"]["per_s"], 3),
        },
    }
    rows = [
        (f"{p} c={c}", f"p50 {v['p50_ms']} ms  p99 {v['p99_ms']} ms  {v['per_s']} req/s")
        for p, by_c in paths.items()
        for c, v in by_c.items()
    ]
    rows += [("OTLP exports received (traced)", f"{receiver.exports} ({receiver.bytes} bytes)")]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("gateway", rows, result, args, plot)


if __name__ == "__main__":
    main()
