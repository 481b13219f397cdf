"""Distributed mode on one machine: every replica and gateway its own `omni` process, a real
nats-server, a real mooncake_master with a store server, N:M replicas, two gateways.

Each stage replica and gateway is started, killed and stopped independently, as pods are."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from omni_cli.mooncaked import LocalMooncake
from tests.helpers import (
    OMNI,
    ROOT,
    OmniProcess,
    decode_wav,
    our_shm_segments,
    replica_metric,
    replicas,
    start_gateway,
    start_stage,
    wait_for,
)

DEMO = ROOT / "examples" / "tiny-omni-distributed.yaml"
SYNTH = ROOT / "tests" / "data" / "synthetic-distributed.yaml"


@dataclass
class Deployment:
    pipeline: Path
    nats_url: str
    cwd: Path
    logs: Path
    stages: dict[str, OmniProcess] = field(default_factory=dict)
    gateways: list[tuple[OmniProcess, str]] = field(default_factory=list)

    def add_stage(self, stage: str, replica: str, wait: bool = False) -> OmniProcess:
        p = start_stage(self.pipeline, stage, replica, self.nats_url, self.cwd, self.logs, wait=wait)
        self.stages[f"{stage}-{replica}"] = p
        return p

    def add_gateway(self) -> str:
        gw = start_gateway(
            self.pipeline, self.nats_url, self.cwd, self.logs, name=f"gateway-{len(self.gateways)}"
        )
        self.gateways.append(gw)
        return gw[1]

    def stop(self) -> None:
        codes = {}
        for name, p in [(f"gateway-{i}", g[0]) for i, g in enumerate(self.gateways)] + list(
            self.stages.items()
        ):
            codes[name] = p.stop()
        assert all(c in (0, -signal.SIGKILL) for c in codes.values()), codes


def deploy(
    pipeline: Path, layout: dict[str, int], gateways: int, nats_url: str, cwd: Path, logs: Path
) -> Deployment:
    d = Deployment(pipeline, nats_url, cwd, logs)
    for stage, n in layout.items():
        for i in range(n):
            d.add_stage(stage, chr(ord("a") + i))
    for _ in range(gateways):
        base = d.add_gateway()
        wait_for(lambda b=base: httpx.get(f"{b}/health").status_code == 200, 120, "every stage registered")
    return d


def ask(base: str, content: str, **extra: object) -> str:
    """One text+audio request; returns 'ok' or the error message."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=90)
    try:
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": content}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            **extra,  # type: ignore[arg-type]
        )
    except openai.APIError as exc:
        return f"error: {exc}"
    samples, _ = decode_wav(r.choices[0].message.audio.data)
    return "ok" if r.choices[0].message.content and len(samples) > 0 else "empty"


@pytest.fixture
def demo(nats_url: str, mooncake: LocalMooncake, demo_dir: Path, tmp_path: Path) -> Iterator[Deployment]:
    d = deploy(DEMO, {"thinker": 1, "talker": 2, "vocoder": 2}, 2, nats_url, demo_dir, tmp_path)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def synth(nats_url: str, mooncake: LocalMooncake, tmp_path: Path) -> Iterator[Deployment]:
    d = deploy(SYNTH, {"thinker": 1, "talker": 2, "vocoder": 1}, 1, nats_url, ROOT, tmp_path)
    try:
        yield d
    finally:
        d.stop()


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
    wait_for(lambda: mooncake.key_count() == 0, 10, "no Mooncake key left")
    assert our_shm_segments() == []


def test_sigkill_of_a_talker_under_load(synth: Deployment, mooncake: LocalMooncake) -> None:
    base = synth.gateways[0][1]
    victim = synth.stages["talker-b"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, base, f"load {i}") for i in range(24)]
        wait_for(
            lambda: replica_metric(base, "talker", "omni_stage_inflight_requests", replica="b") > 0,
            60,
            "talker b to be serving",
        )
        victim.proc.send_signal(signal.SIGKILL)
        results = [f.result(timeout=90) for f in futures]  # every request ends, none hangs
    failures = [r for r in results if r != "ok"]
    assert all("stage 'talker' replica b" in r for r in failures), failures
    assert results.count("ok") >= len(results) - 4  # at most what talker b held at once
    # The survivor serves everything new.
    wait_for(
        lambda: [r["replica"] for r in replicas(base, "talker")] == ["a"], 30, "talker b to leave the table"
    )
    assert [ask(base, f"after {i}") for i in range(4)] == ["ok"] * 4
    wait_for(lambda: mooncake.key_count() == 0, 30, "the dead talker's inputs to be freed")


def test_rolling_restart_under_load_loses_nothing(synth: Deployment, mooncake: LocalMooncake) -> None:
    base = synth.gateways[0][1]
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            results.append(ask(base, f"steady {i}"))
            i += 1

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        for rep in ("a", "b"):
            old = synth.stages[f"talker-{rep}"]
            n = len(results)
            wait_for(lambda n=n: len(results) >= n + 3, 60, "requests to flow")
            old.proc.send_signal(signal.SIGTERM)  # drain: finish what it holds, take nothing new
            assert old.proc.wait(60) == 0, old.output()[-2000:]
            assert "draining" in old.output()
            synth.add_stage("talker", rep, wait=True)
            wait_for(
                lambda r=rep: any(x["replica"] == r and not x["draining"] for x in replicas(base, "talker")),
                30,
                f"the new talker {rep} to register",
            )
        n = len(results)
        wait_for(lambda: len(results) >= n + 3, 60, "requests to flow after the restart")
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    assert len(results) >= 10
    assert results == ["ok"] * len(results), [r for r in results if r != "ok"]
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
