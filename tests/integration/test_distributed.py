"""Distributed mode on one machine: every replica and gateway its own `omni` process, a real
nats-server, a real mooncake_master with a store server, N:M replicas, two gateways.

Each stage replica and gateway is started, killed and stopped independently, as pods are."""

from __future__ import annotations

import base64
import io
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omni_cli.mooncaked import LocalMooncake
from tests.deployment import Deployment, SteadyLoad, ask, deployed
from tests.helpers import (
    HTTP,
    OMNI,
    ROOT,
    OmniProcess,
    our_shm_segments,
    replica_metric,
    replicas,
    wait_for,
)

DEMO = ROOT / "examples" / "tiny-omni-distributed.yaml"
SYNTH = ROOT / "tests" / "data" / "synthetic-distributed.yaml"


@pytest.fixture
def demo(nats_url: str, mooncake: LocalMooncake, demo_dir: Path, tmp_path: Path) -> Iterator[Deployment]:
    with deployed(DEMO, {"thinker": 1, "talker": 2, "vocoder": 2}, 2, nats_url, demo_dir, tmp_path) as d:
        yield d


def test_demo_n_to_m_replicas_two_gateways(demo: Deployment, mooncake: LocalMooncake) -> None:
    bases = [base for _, base in demo.gateways]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: ask(bases[i % 2], f"hello {i}"), range(16)))
    assert results == ["ok"] * 16
    # Load spread over the replicas of each stage, through both gateways.
    for stage in ("talker", "vocoder"):
        for rep in ("a", "b"):
            served = replica_metric(bases[0], stage, "omni_stage_requests_total", replica=rep, outcome="ok")
            assert served >= 2, f"{stage}/{rep} served {served} of 16"
    # The tensor edges went through Mooncake, and nothing is left in it.
    assert (
        replica_metric(bases[0], "thinker", "omni_connector_bytes_total", connector="default", op="put") > 0
    )
    # This thinker reads text only, as its replica declares: an image is refused by the
    # gateway before anything runs (the thinker reads nothing).
    got = replica_metric(bases[0], "thinker", "omni_connector_bytes_total", connector="default", op="get")
    r = HTTP.post(f"{bases[0]}/v1/chat/completions", json=image_request("tiny-omni"), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert "cannot read image_url parts; it reads text" in error["message"]
    assert (
        replica_metric(bases[0], "thinker", "omni_connector_bytes_total", connector="default", op="get")
        == got
    )
    wait_for(lambda: mooncake.key_count() == 0, 10, "no Mooncake key left")
    assert our_shm_segments() == []
    # Uploaded voices live in JetStream in Distributed mode, and this NATS has it off: the
    # gateways serve all else, list no uploaded voice, and refuse an upload saying why.
    base = bases[1]
    r = HTTP.get(f"{base}/v1/audio/voices", timeout=30)
    assert r.status_code == 200 and r.json()["uploaded_voices"] == [], r.text
    form = {"name": "v", "consent": "c"}
    files = {"audio_sample": ("v.wav", b"RIFF", "audio/wav")}
    r = HTTP.post(f"{base}/v1/audio/voices", data=form, files=files, timeout=30)
    assert r.status_code == 503 and "has JetStream off" in r.json()["error"]["message"], r.text


def image_request(model: str) -> dict[str, object]:
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(png, "PNG")
    url = f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}"
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }


def test_media_reach_the_thinker_through_mooncake(
    synth_distributed: Deployment, mooncake: LocalMooncake
) -> None:
    """Media go to a thinker that reads them as tensors in Mooncake (its request edge's
    connector), never on NATS; its read frees them."""
    base = synth_distributed.base
    got = replica_metric(base, "thinker", "omni_connector_bytes_total", connector="default", op="get")
    r = HTTP.post(f"{base}/v1/chat/completions", json=image_request("synthd"), timeout=30)
    assert r.status_code == 200, r.text
    read = replica_metric(base, "thinker", "omni_connector_bytes_total", connector="default", op="get") - got
    assert read > 64 * 64 * 3  # the pixels came through Mooncake
    wait_for(lambda: mooncake.key_count() == 0, 10, "no Mooncake key left")
    assert our_shm_segments() == []


def test_rolling_restart_under_load_loses_nothing(
    synth_distributed: Deployment, mooncake: LocalMooncake
) -> None:
    base = synth_distributed.base
    with SteadyLoad(base) as load:
        for rep in ("a", "b"):
            old = synth_distributed.stages[f"talker-{rep}"]
            load.flowing()
            old.proc.send_signal(signal.SIGTERM)  # drain: finish what it holds, take nothing new
            assert old.proc.wait(60) == 0, old.output()[-2000:]
            assert "draining" in old.output()
            synth_distributed.add_stage("talker", rep, wait=True)
            wait_for(
                lambda r=rep: any(x["replica"] == r and not x["draining"] for x in replicas(base, "talker")),
                30,
                f"the new talker {rep} to register",
            )
        load.flowing()
    assert len(load.results) >= 10
    assert load.failures() == []
    wait_for(lambda: mooncake.key_count() == 0, 10, "no Mooncake key left")


@pytest.mark.parametrize("command", ["stage", "gateway"])
@pytest.mark.parametrize(
    ("url", "why"),
    [("nats//127.0.0.1:4222", "expected nats://host:port"), ("nats://127.0.0.1:42x2", "bad port")],
)
def test_malformed_nats_url_fails_in_one_line(command: str, url: str, why: str) -> None:
    args = ["--pipeline", str(SYNTH), "--nats", url] + (["--stage", "thinker"] if command == "stage" else [])
    out = subprocess.run([*OMNI, command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"omni: malformed NATS URL {url!r}: {why}"]


def test_nats_url_from_the_environment(nats_url: str, tmp_path: Path) -> None:
    plain = ROOT / "tests" / "data" / "synthetic.yaml"  # no NATS URL in the file, none on the command line
    args = ["stage", "--pipeline", str(plain), "--stage", "vocoder", "--metrics-host", "127.0.0.1"]
    p = OmniProcess(args, ROOT, tmp_path / "vocoder.log", {"OMNI_NATS_URL": nats_url})
    try:
        p.wait_output("vocoder/0 ready", 60)
    finally:
        assert p.stop() == 0


@pytest.mark.parametrize("command", ["stage", "gateway"])
def test_sigterm_while_waiting_for_nats_stops_cleanly(command: str, tmp_path: Path) -> None:
    plain = ROOT / "tests" / "data" / "synthetic.yaml"
    extra = ["--stage", "vocoder", "--metrics-host", "127.0.0.1"] if command == "stage" else ["--port", "0"]
    p = OmniProcess(
        [command, "--pipeline", str(plain), "--nats", "nats://127.0.0.1:1", *extra],
        ROOT,
        tmp_path / f"{command}.log",
    )
    p.wait_output("not reachable yet", 60)
    assert p.stop(timeout=30) == 0
    assert "stopped before NATS was reachable" in p.output()
