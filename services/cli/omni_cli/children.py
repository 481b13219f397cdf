"""Entry points of the processes `omni serve` spawns (importable top-level functions, for spawn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_pipeline.spec import load_pipeline


def stage_child(
    ready: Callable[[dict[str, Any]], None], path: str, stage: str, replica: str, nats_url: str
) -> None:
    from omni_stage.proc import run_stage

    run_stage(ready, load_pipeline(path), stage, replica, nats_url, pipeline_path=path)


def gateway_child(
    ready: Callable[[dict[str, Any]], None], path: str, nats_url: str, host: str, port: int
) -> None:
    from omni_gateway.app import run_gateway

    run_gateway(ready, load_pipeline(path), nats_url, host, port)
