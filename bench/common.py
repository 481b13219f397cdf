"""Shared benchmark plumbing: arguments, repeats, percentiles, a table, the JSON last line, a plot."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `xs`, interpolated."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """Every benchmark's arguments: --json (only the JSON line) and --out (save JSON and plot)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--out", type=Path, help="also write <out>/<name>.json and <out>/<name>.png")
    ap.add_argument(
        "--quick", action="store_true", help="a few rounds: checks that it runs, measures nothing"
    )
    return ap


def warmed(args: argparse.Namespace) -> bool:
    """Whether to warm up before measuring: not with --quick (it checks that the benchmark runs,
    not how fast)."""
    return not args.quick


def rounds(n: int, args: argparse.Namespace) -> int:
    """`n` repeats, or one with --quick (which checks that the benchmark runs, not how fast)."""
    return 1 if args.quick else n


def report(
    name: str,
    rows: list[tuple[str, str]],
    result: dict[str, Any],
    args: argparse.Namespace,
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """A table of (what, value), unless --json; with --out the JSON and the plot are saved too.
    The JSON object is always the last line printed."""
    if not args.json:
        width = max(len(k) for k, _ in rows)
        print(f"== {name} ==")
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        if plot is not None:
            plot(result, args.out / f"{name}.png")
    print(json.dumps(result), flush=True)


def figure(ncols: int = 1) -> tuple[Any, Any]:
    """A matplotlib figure and its axes (one, or a tuple of `ncols`), headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(ncols=ncols, figsize=(7 * ncols if ncols > 1 else 7, 4), dpi=100)
    return fig, axes


def bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str = "") -> None:
    """Grouped bars on `ax`: one group per x label, one bar per series in each group."""
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7, ncol=2 if len(series) > 4 else 1)


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
