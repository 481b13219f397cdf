"""Stage workers and a gateway as separate `omni` processes on a real nats-server.

A synthetic pipeline (thinker -> talker (window 8) -> vocoder (window -1)) answers the official
openai client; window triggers are read from each replica's own /metrics; a poisoned input
fails only its request; a client that walks away mid-stream leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from omni_cli.natsd import EmbeddedNats, nats_server_binary
from omni_cli.ports import free_port
from tests.helpers import (
    HTTP,
    ROOT,
    OmniProcess,
    decode_wav,
    openai_client,
    our_shm_segments,
    replica_metric,
    replicas,
    shm_prefix,
    shm_segments_in_use,
    start_gateway,
    start_stage,
    stop_together,
    wait_for,
)

PIPELINE = ROOT / "tests" / "data" / "synthetic.yaml"
PREFIX = shm_prefix("itest")
SHARED_PREFIX = shm_prefix("shared-itest")
"""The module's shared cluster's segments (not a prefix of the other, nor it of this)."""


@dataclass
class Cluster:
    base: str
    stages: dict[str, OmniProcess]


@contextlib.contextmanager
def started(nats_url: str, logs: Path, prefix: str = PREFIX, pipeline: Path = PIPELINE) -> Iterator[Cluster]:
    """A replica per stage and a gateway, each its own process; every one exits 0 at the end,
    and no segment is left."""
    env = {"OMNI_SHM_PREFIX": prefix}
    procs = [
        start_stage(pipeline, s, "0", nats_url, ROOT, logs, env) for s in ("thinker", "talker", "vocoder")
    ]
    gw, base = start_gateway(pipeline, nats_url, ROOT, logs, env=env)
    try:
        wait_for(lambda: HTTP.get(f"{base}/health").status_code == 200, 60, "every stage registered")
        yield Cluster(base, dict(zip(("thinker", "talker", "vocoder"), procs, strict=True)))
    finally:
        for p, code in zip([gw, *procs], stop_together([gw, *procs]), strict=True):
            assert code == 0, p.output()[-2000:]
    assert our_shm_segments(prefix) == []


@pytest.fixture
def cluster_procs(nats_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of the test's own, for a test that stops one of its processes. Its gateway
    waits 1 s, not 30, for a stage with no replica before its 503 (gateway.replicaWaitS)."""
    doc = yaml.safe_load(PIPELINE.read_text())
    doc["spec"]["gateway"]["replicaWaitS"] = 1
    path = tmp_path / "short-wait.yaml"
    path.write_text(yaml.safe_dump(doc))
    with started(nats_url, tmp_path, pipeline=path) as c:
        yield c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One cluster for the module's tests that leave it whole: each stops nothing, waits for
    what it started to end, and reads counters as differences."""
    server = EmbeddedNats()
    try:
        with started(server.url, tmp_path_factory.mktemp("cluster"), SHARED_PREFIX) as c:
            yield c.base
    finally:
        server.stop()


def counts(base: str, name: str, **labels: str) -> dict[str, float]:
    """A counter on each stage's replicas, now."""
    return {s: replica_metric(base, s, name, **labels) for s in ("thinker", "talker", "vocoder")}


def replica_url(base: str, stage: str) -> str:
    return f"http://127.0.0.1:{replicas(base, stage)[0]['metrics_port']}"


def test_windows_trigger_expected_calls_and_audio_arrives(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    before = counts(cluster, "omni_stage_window_triggers_total")
    for i in range(3):
        r = client.chat.completions.create(
            model="synth",
            messages=[{"role": "user", "content": f"hello {i}"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
        assert r.choices[0].message.content == "".join(f"tok{j} " for j in range(20))
        audio, sr = decode_wav(r.choices[0].message.audio.data)
        assert sr == 24000 and len(audio) == 20 * 480
    # thinker: 1 call per request; talker, window 8 over 20 units: 8, 8, 4; vocoder, window -1: 1.
    after = counts(cluster, "omni_stage_window_triggers_total")
    assert {s: after[s] - before[s] for s in after} == {"thinker": 3, "talker": 9, "vocoder": 3}


def test_text_only_request_stops_at_the_thinker(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    before = replica_metric(cluster, "talker", "omni_stage_window_triggers_total")
    r = client.chat.completions.create(
        model="synth", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert r.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 "
    assert r.choices[0].message.audio is None
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert replica_metric(cluster, "talker", "omni_stage_window_triggers_total") == before


def test_a_prompt_of_5_mb_is_served_through_the_connector(cluster: str) -> None:
    """A 5 MB prompt, five times what NATS carries in one message: the gateway puts the
    client's inputs on the thinker's request edge (shared memory here), as stages pass their
    outputs, and the thinker reads them from there."""
    read = replica_metric(cluster, "thinker", "omni_connector_bytes_total", op="get")
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="synth", messages=[{"role": "user", "content": "x" * 5_000_000}])
    assert r.choices[0].message.content and r.usage is not None
    assert replica_metric(cluster, "thinker", "omni_connector_bytes_total", op="get") - read > 5_000_000


def test_poisoned_input_fails_only_its_request(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="synth", messages=[{"role": "user", "content": "POISON"}])
    assert "stage 'thinker'" in str(info.value) and "poisoned" in str(info.value)
    with pytest.raises(openai.InternalServerError):  # the same, streamed: it fails before the stream exists
        client.chat.completions.create(
            model="synth", messages=[{"role": "user", "content": "POISON"}], stream=True
        )
    r = client.chat.completions.create(model="synth", messages=[{"role": "user", "content": "fine"}])
    assert r.choices[0].message.content.startswith("tok0")
    gauge = [
        ln
        for ln in HTTP.get(f"{cluster}/metrics").text.splitlines()
        if ln.startswith("omni_gateway_inflight")
    ]
    assert gauge == [
        "omni_gateway_inflight_requests 0.0"
    ]  # failed requests, streamed or not, are not counted


def test_client_disconnect_mid_stream_frees_everything(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    aborted = replica_metric(cluster, "thinker", "omni_stage_requests_total", outcome="aborted")
    for _ in range(5):
        stream = client.chat.completions.create(
            model="synth",
            messages=[{"role": "user", "content": "long"}],
            max_tokens=2000,
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
        )
        for n, _chunk in enumerate(stream):
            if n == 10:
                assert replica_metric(cluster, "thinker", "omni_stage_tracked_requests") == 1  # still running
                break
        stream.close()
    for stage in ("thinker", "talker", "vocoder"):
        wait_for(
            lambda s=stage: replica_metric(cluster, s, "omni_stage_tracked_requests") == 0,
            30,
            f"{stage} to drop the abandoned requests",
        )
    assert replica_metric(cluster, "thinker", "omni_stage_requests_total", outcome="aborted") == aborted + 5
    wait_for(lambda: shm_segments_in_use(SHARED_PREFIX) == [], 10, "no shm segment in use")
    # And the pipeline still serves.
    r = client.chat.completions.create(model="synth", messages=[{"role": "user", "content": "again"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_non_streaming_client_that_leaves_aborts_its_request(cluster: str) -> None:
    body = {"model": "synth", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 3000}
    aborted = replica_metric(cluster, "thinker", "omni_stage_requests_total", outcome="aborted")
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{cluster}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=1.0))
    wait_for(
        lambda: (
            replica_metric(cluster, "thinker", "omni_stage_requests_total", outcome="aborted") == aborted + 1
        ),
        30,
        "the thinker to abort the abandoned request",
    )
    assert replica_metric(cluster, "thinker", "omni_stage_tracked_requests") == 0


def test_stage_started_before_nats_waits_and_says_so(tmp_path: Path) -> None:
    port = free_port()  # for a NATS server that is not there yet
    url = f"nats://127.0.0.1:{port}"
    stage = OmniProcess(
        [
            "stage",
            "--pipeline",
            str(PIPELINE),
            "--stage",
            "vocoder",
            "--nats",
            url,
            "--metrics-host",
            "127.0.0.1",
        ],
        ROOT,
        tmp_path / "vocoder.log",
    )
    server = None
    try:
        stage.wait_output("not reachable yet", 60)
        server = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL
        )
        stage.wait_output("vocoder/0 ready", 60)
        assert f"connected to NATS at {url}" in stage.output()
    finally:
        assert stage.stop() == 0
        if server is not None:
            server.terminate()
            server.wait(10)


def test_replica_health_endpoints(cluster: str) -> None:
    for stage in ("thinker", "talker", "vocoder"):
        url = replica_url(cluster, stage)
        assert HTTP.get(f"{url}/health/live").json() == {"status": "live"}
        ready = HTTP.get(f"{url}/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_sigterm_drains_in_flight_work_then_exits_0(cluster_procs: Cluster) -> None:
    base, thinker = cluster_procs.base, cluster_procs.stages["thinker"]
    client = openai_client(base)
    stream = client.chat.completions.create(
        model="synth", messages=[{"role": "user", "content": "drain me"}], max_tokens=1500, stream=True
    )
    text = []
    for n, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if n == 5:
            thinker.proc.send_signal(signal.SIGTERM)  # mid-request
    assert "".join(text) == "".join(f"tok{i} " for i in range(1500)), "the in-flight request was cut short"
    assert thinker.proc.wait(30) == 0
    assert "draining 1 requests" in thinker.output()
    wait_for(lambda: HTTP.get(f"{base}/health").status_code == 503, 10, "the gateway to drop the thinker")
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="synth", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503 and "stage 'thinker' has no live replica" in str(info.value)


def test_a_stage_runs_at_its_niceness_and_so_does_every_thread_it_starts(
    nats_url: str, tmp_path: Path
) -> None:
    """`nice` on a stage: Linux keeps a niceness per thread, and a thread takes its starter's, so
    every thread of the process runs at it, those it had before it read its spec and those it
    starts serving requests; the other stages keep theirs."""
    doc = yaml.safe_load(PIPELINE.read_text())
    doc["spec"]["stages"][0]["nice"] = 3
    path = tmp_path / "nice.yaml"
    path.write_text(yaml.safe_dump(doc))
    with started(nats_url, tmp_path, pipeline=path) as c:
        r = openai_client(c.base).chat.completions.create(
            model="synth",
            messages=[{"role": "user", "content": "hello"}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
        assert r.choices[0].message.audio is not None
        own = os.nice(0)  # what the stages start at: this test's own niceness
        for name, want in (("thinker", max(3, own)), ("talker", own)):
            threads = psutil.Process(c.stages[name].proc.pid).threads()
            assert {psutil.Process(t.id).nice() for t in threads} == {want}, name
