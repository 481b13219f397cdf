"""Fault 3: mooncake_master restarts under steady load (the talker -> vocoder edge goes
through Mooncake).

Transfers in flight fail with an error that names Mooncake and what it said; while the master
is away, the replicas that use it take nothing new (503 that says why); the store server
registers with the new master by itself, and later requests succeed; no key is left.
"""

from __future__ import annotations

from omni_cli.mooncaked import LocalMooncake
from tests.deployment import Deployment, SteadyLoad, ask
from tests.helpers import HTTP, replicas, wait_for


def test_mooncake_master_restart_under_load(faults: Deployment, mooncake: LocalMooncake) -> None:
    base = faults.base
    idle = faults.gauges()
    with SteadyLoad(base, workers=4) as load:
        load.flowing()
        mooncake.restart_master()
        wait_for(lambda: ask(base, "probe", timeout=10) == "ok", 30, "a request through the new master")
        load.flowing()
    failures = load.failures()
    # A transfer in flight fails naming Mooncake and what it said; while the master is away
    # the talker and vocoder say they are unhealthy, and new spoken requests are a 503 that
    # says why.
    unhealthy = "no live replica (unhealthy: connector 'remote' (mooncake)"
    assert [f for f in failures if "Mooncake" not in f and unhealthy not in f] == [], failures
    assert load.results.count("ok") >= 6
    faults.settle(idle)
    assert mooncake.key_count() == 0
    print(f"{len(failures)} of {len(load.results)} requests failed; e.g. {failures[:1]}")


def test_a_replica_whose_connector_is_down_takes_nothing_until_it_is_back(
    faults: Deployment, mooncake: LocalMooncake
) -> None:
    """mooncake_master killed and kept down: the talker and the vocoder (whose edge goes through
    it) say so on /health/ready and in their heartbeats, and the gateway routes nothing to
    them: a spoken request is a 503 at once that says why, not a wait or a failed transfer.
    The thinker, which does not use Mooncake, still answers text. With the master back, both
    are ready again and speech is served."""
    base = faults.base
    body = {"model": "faults", "messages": [{"role": "user", "content": "hi"}]}
    speech = {**body, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
    mooncake.kill_master()
    try:
        for stage in ("talker", "vocoder"):
            wait_for(
                lambda s=stage: "connector 'remote' (mooncake): master" in readiness(base, s)[1],
                15,
                f"the {stage} to say its connector is down",
            )
        assert readiness(base, "thinker") == (200, "ok")
        wait_for(
            lambda: all(r["unhealthy"] for s in ("talker", "vocoder") for r in replicas(base, s)),
            10,
            "the gateway to hear it",
        )
        r = HTTP.post(f"{base}/v1/chat/completions", json=speech, timeout=30)
        assert r.status_code == 503, r.text
        assert "unhealthy: connector 'remote' (mooncake)" in r.json()["error"]["message"]
        assert HTTP.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        mooncake.start_master()
    for stage in ("talker", "vocoder"):
        wait_for(lambda s=stage: readiness(base, s) == (200, "ok"), 15, f"the {stage} to be ready again")
    wait_for(lambda: ask(base, "probe", timeout=10) == "ok", 30, "speech served again")


def readiness(base: str, stage: str) -> tuple[int, str]:
    rep = replicas(base, stage)[0]
    r = HTTP.get(f"http://127.0.0.1:{rep['metrics_port']}/health/ready", timeout=5)
    return r.status_code, r.json()["reason"]
