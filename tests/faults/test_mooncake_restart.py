"""Fault 3: mooncake_master restarts under steady load (the talker -> vocoder edge goes
through Mooncake).

Transfers in flight fail with an error that names Mooncake and what it said; the store server
registers with the new master by itself, and later requests succeed; no key is left.
"""

from __future__ import annotations

from omni_cli.mooncaked import LocalMooncake
from tests.deployment import Deployment, SteadyLoad, ask
from tests.helpers import wait_for


def test_mooncake_master_restart_under_load(faults: Deployment, mooncake: LocalMooncake) -> None:
    base = faults.base
    idle = faults.gauges()
    with SteadyLoad(base, workers=4) as load:
        load.flowing()
        mooncake.restart_master()
        wait_for(lambda: ask(base, "probe", timeout=10) == "ok", 30, "a request through the new master")
        load.flowing()
    failures = load.failures()
    assert [f for f in failures if "Mooncake" not in f] == [], failures
    assert load.results.count("ok") >= 6
    faults.settle(idle)
    assert mooncake.key_count() == 0
    print(f"{len(failures)} of {len(load.results)} requests failed; e.g. {failures[:1]}")
