"""Fault 1: SIGKILL of a stage replica under steady load.

No request fails: the ones the dead replica held run again on a fresh route (single node:
they wait for the supervisor to restart the process; distributed: the surviving replica
takes over); the pipeline serves again within 10 s; nothing of ours is left in /dev/shm or
in Mooncake. (tests/faults/test_migration.py: the same with streams, and SIGSTOP.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from omni_cli.mooncaked import INCOMPLETE_PUT_FREED_S, LocalMooncake
from tests.deployment import Deployment, SteadyLoad, ask
from tests.helpers import (
    ROOT,
    OmniProcess,
    get_json,
    our_shm_segments,
    replica_metric,
    replicas,
    wait_for,
    wait_group_gone,
)

SERVES_AGAIN_S = 10.0


def _serves_again(base: str) -> None:
    t0 = time.monotonic()
    wait_for(
        lambda: ask(base, "probe", timeout=SERVES_AGAIN_S) == "ok", SERVES_AGAIN_S, "the pipeline to serve"
    )
    print(f"served again {time.monotonic() - t0:.2f}s after the kill")


def test_single_node_supervisor_restarts_a_killed_stage(tmp_path: Path) -> None:
    pipeline = ROOT / "tests" / "data" / "synthetic.yaml"
    serve = OmniProcess(["serve", str(pipeline), "--port", "0"], ROOT, tmp_path / "serve.log")
    try:
        serve.wait_output("ready at", 180)
        base = re.search(r"ready at (http://127.0.0.1:\d+)/v1", serve.output()).group(1)  # type: ignore[union-attr]
        prefix = re.search(r"shared memory: /dev/shm/(\S+)-\*", serve.output()).group(1)  # type: ignore[union-attr]
        with SteadyLoad(base) as load:
            load.flowing()
            [talker] = replicas(base, "talker")
            wait_for(
                lambda: replica_metric(base, "talker", "omni_stage_inflight_requests") > 0,
                30,
                "a busy talker",
            )
            os.kill(talker["pid"], signal.SIGKILL)
            _serves_again(base)
            load.flowing()
        assert load.failures() == []
        print(f"{len(load.results)} requests, none failed")
        assert "talker-0 died" in serve.output()
        [restarted] = replicas(base, "talker")
        assert restarted["instance"] != talker["instance"]
    finally:
        serve.interrupt_group()
        wait_for(lambda: serve.proc.poll() is not None, 60, "omni serve to exit")
    assert serve.proc.returncode == 0, serve.output()[-3000:]
    wait_group_gone(serve.proc.pid)
    assert our_shm_segments(f"{prefix}-") == []


def test_distributed_survivors_take_over(synth_distributed: Deployment, mooncake: LocalMooncake) -> None:
    base = synth_distributed.base
    with SteadyLoad(base, workers=4) as load:
        load.flowing()
        wait_for(
            lambda: replica_metric(base, "talker", "omni_stage_inflight_requests", replica="b") > 0,
            60,
            "talker b to be serving",
        )
        synth_distributed.stages["talker-b"].proc.send_signal(signal.SIGKILL)
        _serves_again(base)
        load.flowing()
    assert load.failures() == []
    print(f"{len(load.results)} requests, none failed")
    wait_for(lambda: [r["replica"] for r in replicas(base, "talker")] == ["a"], 30, "b to leave the table")
    # Its inputs are freed by the aborts; a put it was making when killed, by the master.
    wait_for(
        lambda: mooncake.key_count() == 0, INCOMPLETE_PUT_FREED_S, "the dead talker's inputs to be freed"
    )
    assert our_shm_segments() == []
    assert get_json(f"{base}/health")["status"] == "ok"
