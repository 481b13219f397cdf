"""A connector failure on any edge fails only its own request, with a message that names the
stage, the connector and what the backend said, and frees what the request held.

Each failure is injected at a moment the test waits for, not left to chance: the vocoder is
slow (tests/data/synthetic-connectors.yaml), so the talker's later windows wait in Mooncake
while it works, and its audio waits in shm for a gateway that the test has paused.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omni_cli.mooncaked import LocalMooncake
from omni_pipeline.connectors import ShmConnector
from omni_pipeline.settings import ConnectorSpec
from tests.deployment import Deployment, ask, deployed, metric_values, metrics_urls
from tests.helpers import ROOT, our_shm_segments, shm_prefix, wait_for

PIPELINE = ROOT / "tests" / "data" / "synthetic-connectors.yaml"
SHM_PREFIX = shm_prefix("connfaults")


@pytest.fixture
def pipeline(nats_url: str, mooncake: LocalMooncake, tmp_path: Path) -> Iterator[Deployment]:
    env = {"OMNI_SHM_PREFIX": SHM_PREFIX}
    with deployed(PIPELINE, {"thinker": 1, "talker": 1, "vocoder": 1}, 1, nats_url, ROOT, tmp_path, env) as d:
        assert ask(d.base, "warm up") == "ok"
        yield d
    assert our_shm_segments(SHM_PREFIX) == []


def count(url: str, name: str) -> float:
    return metric_values(url, (name,)).get(name, 0.0)


def test_mooncake_master_gone_while_the_vocoder_has_windows_to_read(
    pipeline: Deployment, mooncake: LocalMooncake
) -> None:
    urls = metrics_urls(pipeline.bases)
    idle = pipeline.gauges()
    talker_done = count(urls["talker-a"], "omni_stage_requests_total")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, pipeline.base, "windows waiting")
        # The talker has put all its windows; the vocoder is in its first (2 s) call, so the
        # later ones wait for it in Mooncake. Now the master goes.
        wait_for(
            lambda: count(urls["talker-a"], "omni_stage_requests_total") > talker_done,
            30,
            "the talker to finish its part",
        )
        assert mooncake.key_count() >= 1
        mooncake.kill_master()
        result = answer.result(60)
    assert "stage 'vocoder'" in result, result
    assert "connector 'remote' (mooncake): get failed: Mooncake get of connfaults/" in result, result
    mooncake.start_master()
    try:
        wait_for(lambda: ask(pipeline.base, "after") == "ok", 30, "a request through the new master")
    except AssertionError as exc:  # what each process and the store said, for a failure in CI
        raise AssertionError(f"{exc}\n{pipeline.log_tails()}") from None
    pipeline.settle(idle)
    assert mooncake.key_count() == 0


def test_audio_gone_before_the_gateway_reads_it(pipeline: Deployment) -> None:
    """The vocoder's audio for the gateway is freed before the gateway reads it, as a failing
    producer's cleanup frees what it had sent: the gateway answers with a stage error naming
    the connector, not an internal error."""
    urls = metrics_urls(pipeline.bases)
    idle = pipeline.gauges()
    gateway = pipeline.gateways[0][0].proc
    vocoder_done = count(urls["vocoder-a"], "omni_stage_requests_total")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, pipeline.base, "audio freed")
        wait_for(
            lambda: count(urls["vocoder-a"], "omni_stage_tracked_requests") >= 1,
            30,
            "the vocoder to hold the request",
        )
        gateway.send_signal(signal.SIGSTOP)
        try:
            wait_for(
                lambda: count(urls["vocoder-a"], "omni_stage_requests_total") > vocoder_done,
                30,
                "the vocoder to send all its audio",
            )
            written = our_shm_segments(f"{SHM_PREFIX}-")
            rids = {
                n.split("~vocoder-gateway-")[0][len(SHM_PREFIX) + 1 :]
                for n in written
                if "~vocoder-gateway-" in n
            }
            assert len(rids) == 1, written
            freed = ShmConnector("default", ConnectorSpec(), prefix=SHM_PREFIX)
            assert freed.cleanup(rids.pop()) >= 1
        finally:
            gateway.send_signal(signal.SIGCONT)
        result = answer.result(60)
    assert "stage 'vocoder' replica a -> gateway: connector 'default' (shm): get failed: segment" in result, (
        result
    )
    assert "is gone" in result, result
    assert "internal error" not in result
    assert ask(pipeline.base, "after") == "ok"
    pipeline.settle(idle)
