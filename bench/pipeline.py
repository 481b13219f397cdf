"""pipeline: throughput of a 3-stage pipeline against the ideal its slowest stage allows.

`omni serve` of a synthetic pipeline a -> b -> c (each stage one call per request, after the
whole input: window -1; maxInflight 1; the costs are sleeps standing in for a GPU). 16 clients
send chat completions through the gateway in a closed loop; throughput is completed requests /
wall time, after a warm-up. With cross-stage pipelining (seed 000, section 8) every stage
works on a different request at once, so throughput approaches 1 / the slowest stage's cost.

- throughput_vs_ideal: costs 10/30/20 ms, one replica each; measured / (1 / 30 ms). Goal >= 0.9.
- bottleneck_2_replicas_speedup: costs 10/30/12 ms, b at 2 replicas vs 1. The ideal is 2x
  (b's 30 ms shared by two replicas leaves 15 ms the slowest). Goal >= 1.8. (With 10/30/20 the
  third stage caps the speedup at 1.5x, so this run makes it cheaper.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.common import bars, figure, machine, parser, report, rounds, save
from bench.load import chat, closed_loop
from bench.procs import served

CONCURRENCY = 16
WARMUP = 24
REQUESTS = 240


def spec(costs_ms: tuple[int, int, int], b_replicas: int) -> dict[str, Any]:
    a, b, c = costs_ms
    return {
        "servedModelName": "bench",
        "gateway": {"requestTimeoutS": 120},
        "stages": [
            {
                "name": "a",
                "engine": {"kind": "synthetic", "args": {"unitsPerCall": 4, "msPerCall": a}},
                "inputs": [{"from": "request"}],
            },
            {
                "name": "b",
                "engine": {"kind": "synthetic", "args": {"msPerCall": b}},
                "inputs": [{"from": "a", "window": -1}],
                "replicas": b_replicas,
            },
            {
                "name": "c",
                "engine": {"kind": "synthetic", "args": {"msPerCall": c}},
                "inputs": [{"from": "b", "window": -1}],
                "finalOutput": "text",
            },
        ],
    }


def ideal_per_s(costs_ms: tuple[int, int, int], b_replicas: int) -> float:
    a, b, c = costs_ms
    return 1000 / max(a, b / b_replicas, c)


async def throughput(base: str, args: Any) -> float:
    body = chat("go")
    await closed_loop(base, body, rounds(WARMUP, args), CONCURRENCY)
    return (await closed_loop(base, body, rounds(REQUESTS, args), CONCURRENCY)).per_s


RUNS: list[tuple[str, tuple[int, int, int], int]] = [
    ("10/30/20, b x1", (10, 30, 20), 1),
    ("10/30/12, b x1", (10, 30, 12), 1),
    ("10/30/12, b x2", (10, 30, 12), 2),
]


def plot(result: dict[str, Any], path: Any) -> None:
    fig, ax = figure()
    runs = result["runs"]
    series = {
        "ideal (1 / slowest stage)": [r["ideal_per_s"] for r in runs],
        "measured": [r["measured_per_s"] for r in runs],
    }
    bars(ax, [r["run"] for r in runs], series, "requests / s", "3-stage pipeline throughput (maxInflight 1)")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    runs = []
    for label, costs, replicas in RUNS:
        with served("bench", spec(costs, replicas)) as base:
            measured = asyncio.run(throughput(base, args))
        ideal = ideal_per_s(costs, replicas)
        runs.append(
            {
                "run": label,
                "ideal_per_s": round(ideal, 2),
                "measured_per_s": round(measured, 2),
                "vs_ideal": round(measured / ideal, 3),
            }
        )
    result = {
        "benchmark": "pipeline",
        "machine": machine(),
        "concurrency": CONCURRENCY,
        "requests": rounds(REQUESTS, args),
        "runs": runs,
        "ratios": {
            "throughput_vs_ideal": runs[0]["vs_ideal"],
            "bottleneck_2_replicas_speedup": round(runs[2]["measured_per_s"] / runs[1]["measured_per_s"], 2),
            "throughput_vs_ideal_2_replicas": runs[2]["vs_ideal"],
        },
    }
    rows = [
        (r["run"], f"{r['measured_per_s']} req/s (ideal {r['ideal_per_s']}, {r['vs_ideal']} of it)")
        for r in runs
    ]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("pipeline", rows, result, args, plot)


if __name__ == "__main__":
    main()
