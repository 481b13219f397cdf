"""Fault 2: the nats-server restarts under steady load.

Gateway and replicas reconnect by themselves; requests in flight end at once with a clear
error (their outputs may have been lost with the server) or with their result; new requests
succeed within 5 s of NATS coming back; nothing is left held afterwards.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from omni_cli.serve import MAX_QUICK_DEATHS
from tests.deployment import Deployment, SteadyLoad, ask
from tests.faults.conftest import SHM_PREFIX
from tests.helpers import HTTP, ROOT, OmniProcess, assert_all_gone, served, shm_segments_in_use, wait_for

BACK_WITHIN_S = 5.0


def test_nats_restart_under_load(faults: Deployment, nats: EmbeddedNats, mooncake: LocalMooncake) -> None:
    base = faults.base
    idle = faults.gauges()
    restarted: EmbeddedNats | None = None
    try:
        with SteadyLoad(base, workers=4) as load, ThreadPoolExecutor(1) as pool:
            # A long stream too: its stages are writing payloads when the server goes, which is
            # when a write in progress could escape the first cleanup.
            long = pool.submit(ask, base, "a long one", max_tokens=3000)
            load.flowing()
            nats.stop()
            wait_for(lambda: HTTP.get(f"{base}/health").status_code == 503, 10, "the gateway to notice")
            restarted = EmbeddedNats(port=nats.port, monitor=True)
            back = time.monotonic()
            wait_for(lambda: ask(base, "probe", timeout=BACK_WITHIN_S) == "ok", BACK_WITHIN_S, "a request")
            served_again_s = time.monotonic() - back
            load.flowing()
        assert long.result() == "ok" or "Error code: 503" in long.result(), long.result()
        failures = load.failures()
        # Each a 503 saying why (NATS lost, or a replica not yet back on it): none waited for its
        # deadline, none is a stage error.
        assert [f for f in failures if "Error code: 503" not in f] == [], failures
        assert load.results.count("ok") >= 6
        for p in faults.stages.values():
            assert "reconnected to NATS" in p.output()
        faults.settle(idle)
        assert shm_segments_in_use(SHM_PREFIX) == [] and mooncake.key_count() == 0
        print(f"served again {served_again_s:.2f}s after NATS came back")
        kinds = collections.Counter(
            "in flight" if "lost its connection" in f else "refused" for f in failures
        )
        print(f"{len(load.results)} requests: {dict(kinds)} failed")
    finally:
        if restarted is not None:
            restarted.stop()


SYNTH = ROOT / "tests" / "data" / "synthetic.yaml"


def nats_child(serve: OmniProcess) -> psutil.Process:
    [server] = [p for p in psutil.Process(serve.proc.pid).children() if p.name() == "nats-server"]
    return server


def test_omni_serve_restarts_its_nats_server(tmp_path: Path) -> None:
    """SIGKILL of `omni serve`'s embedded nats-server: the supervisor reaps it (no zombie) and
    starts another on the same port; every process reconnects and it serves again at once.
    Every process of the tree says what it is in `ps`."""
    with served(SYNTH, ROOT, tmp_path / "serve.log") as (serve, base):
        assert ask(base, "first") == "ok"
        tree = psutil.Process(serve.proc.pid)
        # (the stages and the gateway are the children of its fork server)
        titles = {" ".join(p.cmdline()).strip() for p in tree.children(recursive=True)}  # a title is padded
        print("ps -o cmd:", sorted([" ".join(tree.cmdline()).strip(), *titles]))
        assert " ".join(tree.cmdline()).strip() == "omni: supervisor synth"
        named = {f"omni: stage {s} replica 0" for s in ("thinker", "talker", "vocoder")} | {"omni: gateway"}
        assert named <= titles
        old = nats_child(serve)
        old.kill()
        killed = time.monotonic()
        wait_for(lambda: ask(base, "probe", timeout=BACK_WITHIN_S) == "ok", BACK_WITHIN_S, "a request")
        print(f"served again {time.monotonic() - killed:.2f}s after the kill")
        assert nats_child(serve).pid != old.pid
        assert [p for p in tree.children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE] == []
        assert "nats-server died (exit code -9); restarting" in serve.output()
    # served(): every process gone, no segment left


def test_a_nats_server_that_keeps_dying_stops_omni_serve(tmp_path: Path) -> None:
    """Rather than a pipeline that answers 503 for ever: a message naming it, and exit 1."""
    serve = OmniProcess(["serve", str(SYNTH), "--port", "0"], ROOT, tmp_path / "serve.log")
    killed: set[int] = set()

    def fresh() -> psutil.Process | None:
        for p in psutil.Process(serve.proc.pid).children():
            if p.name() == "nats-server" and p.pid not in killed and p.status() != psutil.STATUS_ZOMBIE:
                return p
        return None

    try:
        serve.wait_output("ready at", 180)
        for _ in range(MAX_QUICK_DEATHS):
            server = wait_for(fresh, 30, "a nats-server not killed yet")
            server.kill()
            killed.add(server.pid)
        assert serve.proc.wait(60) == 1
    finally:
        serve.interrupt_group()
    assert f"omni serve: nats-server died {MAX_QUICK_DEATHS} times in a row" in serve.output()
    assert_all_gone(serve, exit_code=1)
