"""The Mooncake connector against a real mooncake_master: across processes, nothing left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from omni_cli.mooncaked import LocalMooncake
from omni_cli.ports import MOONCAKE_RANDOM_PORTS, free_port
from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorError
from omni_pipeline.connectors.mooncake import MooncakeConfig, MooncakeConnector
from omni_pipeline.settings import ConnectorSpec, MooncakeSpec
from tests.helpers import OMNI, ROOT, read_handles, wait_for

SPEC = ConnectorSpec(kind="mooncake", inline_threshold_bytes=1024)


def _producer(env: dict[str, str], requests: int, out: Connection) -> None:
    os.environ.update(env)
    conn = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    for r in range(requests):
        for seq in range(2):
            payload = {"hidden": torch.full((128, 64), float(r)), "seq": seq}
            ok, _, handle = conn.put("thinker", "talker", f"req{r}", payload, seq=seq)
            assert ok and handle.key == f"tiny/req{r}/thinker/talker/{seq}"
            out.send_bytes(wire.encode(handle))
    out.close()
    conn.close()


def test_put_get_cleanup_across_processes(mooncake: LocalMooncake) -> None:
    consumer = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    try:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_producer, args=(mooncake.env(), 10, writer))
        proc.start()
        writer.close()
        handles = read_handles(reader)
        proc.join(60)
        assert proc.exitcode == 0 and len(handles) == 20
        assert mooncake.key_count() == 20

        for h in handles[:10]:  # requests 0..4 are read: each read removes its key at once
            rid = h.key.split("/")[1]  # type: ignore[union-attr]
            data, _ = consumer.get("thinker", "talker", rid, h)
            assert data["hidden"][0, 0].item() == float(rid.removeprefix("req"))
        assert mooncake.key_count() == 10
        for r in range(5, 10):  # requests 5..9 are aborted
            assert consumer.cleanup(f"req{r}") == 2
        assert mooncake.key_count() == 0
        assert consumer.health() == {"ok": True, "status": "healthy", "master": mooncake.master}
    finally:
        consumer.close()


def test_a_key_of_another_request_is_refused(mooncake: LocalMooncake) -> None:
    conn = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    try:
        _, _, h = conn.put("a", "b", "r1", {"x": torch.ones(1000)})
        with pytest.raises(ConnectorError, match="does not belong"):
            conn.get("a", "b", "r2", h)
        assert conn.cleanup("r1") == 1
    finally:
        conn.close()


def test_a_replica_frees_by_name_what_it_wrote_and_searches_nothing(mooncake: LocalMooncake) -> None:
    """`free_written` (a replica's request ended short) removes the keys this connector put for
    the request, by name; where it put none, the master is asked nothing. `discard` removes the
    one payload a replica was handed and will not read. Neither searches the store (the
    master's `remove_by_regex`, which matches every key it holds): that is `cleanup`'s, the
    gateway's backstop."""
    writer = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    reader = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    try:
        handles = {
            (rid, seq): writer.put("a", "b", rid, {"x": torch.ones(1000)}, seq=seq)[2]
            for rid in ("r1", "r2")
            for seq in range(2)
        }
        scans, removals = (
            mooncake.metric(f"master_{m}_requests_total") for m in ("remove_by_regex", "remove")
        )
        assert mooncake.key_count() == 4 and writer.live_objects() == 4

        assert reader.free_written("r1") == 0  # it wrote nothing: nothing asked
        assert mooncake.metric("master_remove_requests_total") == removals
        assert writer.free_written("r1") == 2 and writer.free_written("r1") == 0
        assert mooncake.key_count() == 2 and writer.live_objects() == 2

        reader.discard("r2", handles["r2", 0])
        reader.discard("r1", handles["r2", 1])  # a key of another request: left alone
        assert mooncake.key_count() == 1
        assert writer.live_objects() == 1  # seen gone

        assert writer.free_written("r2") == 1 and mooncake.key_count() == 0
        assert mooncake.metric("master_remove_by_regex_requests_total") == scans
    finally:
        reader.close()
        writer.close()


def test_a_put_waits_for_a_store_server_the_master_expired(mooncake: LocalMooncake) -> None:
    """The store server stalls past the master's client TTL (SIGSTOP: a host that stopped
    running it, as a loaded CI machine once did): the master unmounts its memory, and a put
    finds no store server (NO_AVAILABLE_HANDLE). A put made then waits, and lands once the
    store server is back and has mounted its memory again at its next heartbeat."""
    conn = MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))
    payload = {"x": torch.arange(1000.0)}
    try:
        with ThreadPoolExecutor(1) as pool:
            mooncake.pause_store_server()
            try:
                wait_for(
                    lambda: mooncake.metric("master_total_capacity_bytes") == 0,
                    30,
                    "the master to expire the store server",
                )
                refused = mooncake.metric("master_put_start_failures_total")
                put = pool.submit(conn.put, "a", "b", "r1", payload)
                wait_for(
                    lambda: mooncake.metric("master_put_start_failures_total") > refused,
                    10,
                    "the put to find no store server",
                )
            finally:
                mooncake.resume_store_server()
            _, _, handle = put.result()  # within PUT_WAIT_S, or it raises
        data, _ = conn.get("a", "b", "r1", handle)
        assert torch.equal(data["x"], payload["x"])
    finally:
        conn.close()


def test_a_master_that_stops_answering_fails_each_call_within_the_rpc_timeout(
    mooncake: LocalMooncake,
) -> None:
    """mooncake_master stopped (SIGSTOP: the kernel still takes connections, nothing answers;
    a stalled host): a get and the cleanup queued behind it on the same thread, as a process's
    connector calls run, each fail within `rpcTimeoutMs`, the get naming RPC_TIMEOUT. Mooncake's
    own wait is 30 s a call: these two held every transfer of the process for a minute, the hang
    the fault suite once showed after a master restart. Meanwhile the connector's health says
    the master does not answer (a stage then takes nothing new); once it answers, the count
    each heartbeat makes hears it, health is back, calls succeed, and the request's cleanup
    leaves nothing."""
    config = MooncakeConfig.resolve(MooncakeSpec(rpc_timeout_ms=1000))
    conn = MooncakeConnector("tensors", SPEC, "tiny", config)
    try:
        _, _, handle = conn.put("a", "b", "r1", {"x": torch.arange(1000.0)})
        with ThreadPoolExecutor(1) as pool:
            mooncake.pause_master()
            try:
                get = pool.submit(conn.get, "a", "b", "r1", handle)
                cleanup = pool.submit(conn.cleanup, "r1")
                wait_for(cleanup.done, 15, "both calls to fail (30 s apiece without the bound)")
                health = conn.health()
            finally:
                mooncake.resume_master()
        assert health == {
            "ok": False,
            "status": f"master {mooncake.master} does not answer (code -901 (RPC_TIMEOUT))",
            "master": mooncake.master,
        }
        # What each heartbeat counts asks the master, even a connector of the process (one
        # store client) that holds nothing to count.
        idle = MooncakeConnector("idle", SPEC, "tiny", config)
        assert idle.live_objects() == 0
        idle.close()
        assert conn.health() == {"ok": True, "status": "healthy", "master": mooncake.master}
        with pytest.raises(ConnectorError, match="RPC_TIMEOUT"):
            get.result()
        assert cleanup.result() == 0
        _, _, handle = conn.put("a", "b", "r2", {"x": torch.arange(1000.0)})
        data, _ = conn.get("a", "b", "r2", handle)
        assert torch.equal(data["x"], torch.arange(1000.0))
        conn.cleanup("r1")  # (the master, woken, may have run the one that timed out already)
        assert mooncake.key_count() == 0
    finally:
        conn.close()


def test_a_store_server_that_stops_answering_fails_a_get_within_the_status_timeout(
    mooncake: LocalMooncake,
) -> None:
    """The store server stopped (SIGSTOP, well within the master's client TTL): a get of what it
    holds fails within `tcpStatusTimeoutS` naming TRANSFER_FAIL (Mooncake's own wait: 30 s, and
    every transfer of the process queued behind it). Nothing is lost: the payload is read once
    the store server answers again."""
    config = MooncakeConfig.resolve(MooncakeSpec(tcp_status_timeout_s=1))
    conn = MooncakeConnector("tensors", SPEC, "tiny", config)
    payload = {"x": torch.arange(1000.0)}
    try:
        _, _, handle = conn.put("a", "b", "r1", payload)
        with ThreadPoolExecutor(1) as pool:
            mooncake.pause_store_server()
            try:
                get = pool.submit(conn.get, "a", "b", "r1", handle)
                wait_for(get.done, 8, "the get to fail (30 s without the bound)")
            finally:
                mooncake.resume_store_server()
        with pytest.raises(ConnectorError, match="TRANSFER_FAIL"):
            get.result()
        data, _ = conn.get("a", "b", "r1", handle)
        assert torch.equal(data["x"], payload["x"])
        assert mooncake.key_count() == 0
    finally:
        conn.close()


def test_a_store_server_that_cannot_serve_its_port_fails_the_start(tmp_path: Path) -> None:
    """Another process holds the store server's port (in CI, once, a stage's transfer engine
    took it between the pick and the bind: both drew from Mooncake's own random range). The
    store server mounts its memory, cannot serve its port, and goes on running without it; the
    master drops its memory 10 s later, and then every put finds no store server (the
    NO_AVAILABLE_HANDLE of test_demo_n_to_m_replicas_two_gateways) and what was put is gone
    (an OBJECT_NOT_FOUND in test_migration's first request). The start says so instead of
    handing out that store; and the ports it picks keep out of Mooncake's random ranges."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # It exits, or runs on without its port: either way the start fails, naming it.
        with pytest.raises((RuntimeError, TimeoutError), match=f"the store server to serve :{port}"):
            LocalMooncake(tmp_path, store_port=port)
    picked = {free_port() for _ in range(500)}
    assert not [p for p in picked if any(p in r for r in MOONCAKE_RANDOM_PORTS)]


def test_unreachable_master_fails_fast_and_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_MOONCAKE_MASTER", "127.0.0.1:1")
    monkeypatch.setenv("OMNI_MOONCAKE_METADATA", "http://127.0.0.1:2/metadata")
    with pytest.raises(ConnectorError, match=r"Mooncake master at 127.0.0.1:1 unreachable"):
        MooncakeConnector("tensors", SPEC, "tiny", MooncakeConfig.resolve(None))


def test_missing_configuration_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("OMNI_MOONCAKE_METADATA", raising=False)
    with pytest.raises(ConnectorError, match="OMNI_MOONCAKE_MASTER"):
        MooncakeConfig.resolve(None)


def test_omni_stage_with_unreachable_mooncake_exits_with_one_line(nats_url: str) -> None:
    env = {
        **os.environ,
        "OMNI_MOONCAKE_MASTER": "127.0.0.1:1",
        "OMNI_MOONCAKE_METADATA": "http://127.0.0.1:2/m",
    }
    out = subprocess.run(
        [
            *OMNI,
            "stage",
            "--pipeline",
            str(ROOT / "examples" / "tiny-omni-distributed.yaml"),
            "--stage",
            "thinker",
            "--nats",
            nats_url,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("omni:")]
    assert lines == ["omni: Mooncake master at 127.0.0.1:1 unreachable: [Errno 111] Connection refused"]
