"""sleep: what putting a stage to sleep frees and what waking it costs, for every stage of the
tiny demo (examples/tiny-omni.yaml) and of the tiny Qwen2.5-Omni (examples/qwen2.5-omni.yaml),
through the gateway's POST /v1/omni/sleep and /v1/omni/wakeup, as a client calls them.

Each stage is put to sleep at level 1 and woken, then at level 2 and woken, one stage at a
time. Per stage and level, from the replicas' own acks: the weight bytes that left the engine's
device, the process's resident memory before and after, the seconds to sleep and to wake. On
the CPU, level 1 (weights to host memory) has nothing to move; level 2 drops them and waking
reads them from the checkpoint again. A request through the whole pipeline after each wake
checks that every stage serves again.

--quick measures the tiny demo's talker only. Ratios, measured in the run: per pipeline, each stage
process's resident memory asleep at level 2 over awake (the smallest and the largest over its
stages).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.common import bars, figure, machine, parser, report, save
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = {"tiny-omni": "tiny-omni.yaml", "qwen2.5-omni": "qwen2.5-omni.yaml"}


def control(base: str, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/omni/{path}", json=body, timeout=300)
    r.raise_for_status()
    (ack,) = r.json()["acks"]
    return dict(ack)


def speak(base: str) -> None:
    """One request that needs every stage (text and audio)."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "Hello"}],
        "modalities": ["text", "audio"],
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    assert r.json()["choices"][0]["message"]["audio"]["data"]


def measure(example: str, only: str | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """stage -> level -> what its sleep freed and what its wake cost (every stage, or `only`)."""
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / example).read_text())["spec"])
    spec["servedModelName"] = "bench"
    out: dict[str, dict[str, dict[str, float]]] = {}
    with demo_models() as cwd, served("bench", spec, cwd=cwd) as base:
        speak(base)  # warm: every stage has served once
        for stage in [s["name"] for s in spec["stages"] if only in (None, s["name"])]:
            for level in (1, 2):
                slept = control(base, "sleep", stage_ids=[stage], level=level)
                woke = control(base, "wakeup", stage_ids=[stage])
                speak(base)
                m = slept["metadata"]
                out.setdefault(stage, {})[f"level{level}"] = {
                    "freed_bytes": slept["freed_bytes"],
                    "rss_mb_before": round(m["rss_bytes_before"] / 1e6, 1),
                    "rss_mb_asleep": round(m["rss_bytes_after"] / 1e6, 1),
                    "sleep_s": round(m["seconds"], 3),
                    "wake_s": round(woke["metadata"]["seconds"], 3),
                }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Per stage: the weights a level-2 sleep dropped, and how far the resident memory fell."""
    fig, axes = figure(len(result["runs"]))
    for ax, (name, stages) in zip(
        axes if len(result["runs"]) > 1 else [axes], result["runs"].items(), strict=True
    ):
        l2 = {s: m["level2"] for s, m in stages.items()}
        series = {
            "weights dropped (MB)": [l2[s]["freed_bytes"] / 1e6 for s in l2],
            "resident memory fell by (MB)": [l2[s]["rss_mb_before"] - l2[s]["rss_mb_asleep"] for s in l2],
        }
        bars(ax, list(l2), series, "MB", f"{name}: level-2 sleep")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    if args.quick:
        runs = {"tiny-omni": measure(PIPELINES["tiny-omni"], only="talker")}
    else:
        runs = {name: measure(example) for name, example in PIPELINES.items()}
    ratios = {}
    for name, stages in runs.items():
        kept = [s["level2"]["rss_mb_asleep"] / s["level2"]["rss_mb_before"] for s in stages.values()]
        ratios[f"{name}_rss_asleep_vs_awake_min"] = round(min(kept), 3)
        ratios[f"{name}_rss_asleep_vs_awake_max"] = round(max(kept), 3)
    result = {"benchmark": "sleep", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [
        (f"{name} {stage} {level}", "  ".join(f"{k} {v}" for k, v in m.items()))
        for name, stages in runs.items()
        for stage, levels in stages.items()
        for level, m in levels.items()
    ]
    rows += [(k, str(v)) for k, v in ratios.items()]
    report("sleep", rows, result, args, plot)


if __name__ == "__main__":
    main()
