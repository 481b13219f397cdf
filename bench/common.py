"""Shared benchmark plumbing: repeats, medians, a table, the JSON last line."""

from __future__ import annotations

import json
import platform
import statistics
from typing import Any

import psutil
import torch


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


def report(name: str, rows: list[tuple[str, str]], result: dict[str, Any], as_json: bool) -> None:
    """A table of (what, value), unless `as_json`; the JSON object is always the last line."""
    if not as_json:
        width = max(len(k) for k, _ in rows)
        print(f"== {name} ==")
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    print(json.dumps(result))
