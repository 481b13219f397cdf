"""The fault tests' deployment: every replica and the gateway its own process, a real
nats-server (with its monitoring port, to count subscriptions from the server's side), a real
mooncake_master with a store server, and shared memory under a prefix of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_cli.mooncaked import LocalMooncake
from omni_cli.natsd import EmbeddedNats
from tests.deployment import Deployment, ask, deployed
from tests.helpers import ROOT, our_shm_segments, shm_prefix

PIPELINE = ROOT / "tests" / "data" / "synthetic-faults.yaml"
SHM_PREFIX = shm_prefix("faults")


@pytest.fixture
def nats() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(monitor=True)
    yield server
    server.stop()


@pytest.fixture
def faults(nats: EmbeddedNats, mooncake: LocalMooncake, tmp_path: Path) -> Iterator[Deployment]:
    """One replica per stage, one gateway, warmed by one request (the first one makes what a
    process keeps for good: NATS's reply subscription, pooled segments); afterwards no segment
    of ours is left in /dev/shm."""
    env = {"OMNI_SHM_PREFIX": SHM_PREFIX}
    with deployed(PIPELINE, {"thinker": 1, "talker": 1, "vocoder": 1}, 1, nats.url, ROOT, tmp_path, env) as d:
        assert ask(d.base, "warm up") == "ok"
        yield d
    assert our_shm_segments(SHM_PREFIX) == []
