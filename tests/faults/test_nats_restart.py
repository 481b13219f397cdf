"""Fault 2: the nats-server restarts under steady load.

Gateway and replicas reconnect by themselves; requests in flight end at once with a clear
error (their outputs may have been lost with the server) or with their result; new requests
succeed within 5 s of NATS coming back; nothing is left held afterwards.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from tests.deployment import Deployment, SteadyLoad, ask
from tests.faults.conftest import SHM_PREFIX
from tests.helpers import shm_segments_in_use, wait_for

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
            wait_for(lambda: httpx.get(f"{base}/health").status_code == 503, 10, "the gateway to notice")
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
