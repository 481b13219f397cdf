"""The SHM connector across real processes: 0600 segments, zero-copy reads into warm reused
memory, and nothing left behind on read, abort, or a crash on either side."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import stat
import threading
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorError, ConnectorHandle, PayloadGone, ShmConnector
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.settings import ConnectorSpec
from tests.helpers import our_shm_segments, read_handles, shm_prefix, shm_segments_in_use

SPEC = ConnectorSpec(kind="shm", inline_threshold_bytes=1024)
SPAWN = mp.get_context("spawn")


def _prefix() -> str:
    return shm_prefix(uuid.uuid4().hex[:6])


def _producer(prefix: str, requests: int, out: Connection) -> None:
    """Puts 3 payloads per request, then exits without closing: its segments outlive it."""
    conn = ShmConnector("default", SPEC, prefix=prefix)
    for r in range(requests):
        for seq in range(3):
            payload = {"hidden": torch.full((256, 64), float(r * 10 + seq)), "token_ids": torch.arange(256)}
            ok, nbytes, handle = conn.put("thinker", "talker", f"req{r}", payload, seq=seq)
            assert ok and nbytes > 64 * 1024 and handle.key is not None
            out.send_bytes(wire.encode(handle))
    out.close()
    os._exit(0)


def _pooling_producer_that_dies(prefix: str) -> None:
    """Leaves two idle pooled segments behind, and one it is writing."""
    conn = ShmConnector("default", SPEC, prefix=prefix)
    for numel in (100_000, 1_000_000):
        _, _, h = conn.put("a", "b", "r1", {"x": torch.ones(numel)})
        conn.get("a", "b", "r1", h)
    conn._claim(10_000_000)
    os._exit(0)


def _reader_that_dies(prefix: str, handle: bytes) -> None:
    """Reads a payload and dies holding its tensors (no finalizer runs on _exit)."""
    data, _ = ShmConnector("default", SPEC, prefix=prefix).get(
        "a", "b", "r1", wire.decode(handle, ConnectorHandle)
    )
    assert data["x"].sum().item() == 100_000.0
    os._exit(0)


def _read_in_a_process_that_dies(prefix: str, handle: ConnectorHandle) -> int:
    """Its pid, once it has read the payload and died holding it."""
    proc = SPAWN.Process(target=_reader_that_dies, args=(prefix, wire.encode(handle)))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and proc.pid is not None
    return proc.pid


def test_put_get_cleanup_across_processes() -> None:
    prefix = _prefix()
    consumer = ShmConnector("default", SPEC, prefix=prefix)
    reader, writer = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=_producer, args=(prefix, 20, writer))
    proc.start()
    writer.close()
    handles = read_handles(reader)
    proc.join(30)
    assert proc.exitcode == 0 and len(handles) == 60

    # Each segment is private to its owner and named after its request.
    assert handles[0].key is not None and handles[0].key.startswith(f"{prefix}-req0~thinker-talker-0@")
    assert stat.S_IMODE(os.stat(f"/dev/shm/{handles[0].key}").st_mode) == 0o600

    # Requests 0..9 are read; 10..19 are aborted.
    for i, h in enumerate(handles[:30]):
        data, nbytes = consumer.get("thinker", "talker", f"req{i // 3}", h)
        assert nbytes == h.nbytes
        assert data["hidden"][0, 0].item() == float((i // 3) * 10 + i % 3)
        assert torch.equal(data["token_ids"], torch.arange(256))
    del data
    # Each read segment went when its tensors did: its owner is gone, so nobody would reuse it.
    assert len(our_shm_segments(prefix)) == 30
    for r in range(10, 20):
        assert consumer.cleanup(f"req{r}") == 3
    assert our_shm_segments(prefix) == []
    assert consumer.live_objects() == 0


def test_segments_are_reused_and_reads_are_zero_copy_views() -> None:
    prefix = _prefix()
    producer = ShmConnector("default", SPEC, prefix=prefix)
    try:
        inodes = set()
        for r in range(10):
            _, _, h = producer.put("a", "b", f"r{r}", {"x": torch.full((100_000,), float(r))})
            inodes.add(os.stat(f"/dev/shm/{h.key}").st_ino)
            data, _ = producer.get("a", "b", f"r{r}", h)
            assert data["x"][-1].item() == float(r)
            del data
        assert len(inodes) == 1, "one warm segment serves every request in turn"

        # A segment is not reused while a reader's tensors are views on it ...
        _, _, h1 = producer.put("a", "b", "held", {"x": torch.ones(100_000)})
        x = producer.get("a", "b", "held", h1)[0]["x"]
        _, _, h2 = producer.put("a", "b", "next", {"x": torch.zeros(100_000)})
        assert os.stat(f"/dev/shm/{h2.key}").st_ino not in inodes
        assert x.sum().item() == 100_000.0
        # ... and they are writable views on it, not copies.
        x[0] = 5.0
        (held,) = [p for p in our_shm_segments(prefix) if "-@held-" in p]
        assert b"\x00\x00\xa0\x40\x00\x00\x80\x3f" in Path(f"/dev/shm/{held}").read_bytes()
        del x
        gc.collect()
        assert shm_segments_in_use(prefix) == [h2.key]
    finally:
        producer.close()
        assert producer.cleanup("next") == 1  # returned to an owner that closed: a late release
        producer.sweep()


def test_a_reader_that_dies_gives_its_segment_back() -> None:
    prefix = _prefix()
    producer = ShmConnector("default", SPEC, prefix=prefix)
    try:
        _, _, h = producer.put("a", "b", "r1", {"x": torch.ones(100_000)})
        _read_in_a_process_that_dies(prefix, h)
        assert [p for p in our_shm_segments(prefix) if "-@held-" in p], "the dead reader still holds it"
        pooled = producer.pooled_bytes()
        _, _, h2 = producer.put("a", "b", "r2", {"x": torch.ones(100_000)})
        assert producer.pooled_bytes() == pooled, "the owner took the segment back instead of a new one"
        assert shm_segments_in_use(prefix) == [h2.key]
    finally:
        producer.close()
        producer.sweep()


def test_a_dead_producers_segments_are_freed_by_cleanup_and_sweep() -> None:
    prefix = _prefix()
    reader, writer = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=_producer, args=(prefix, 2, writer))
    proc.start()
    writer.close()
    assert len(read_handles(reader)) == 6
    proc.join(30)
    other = ShmConnector("other", SPEC, prefix=prefix)
    assert other.cleanup("req0") == 3
    assert len(our_shm_segments(prefix)) == 3
    assert other.sweep() == 3
    assert our_shm_segments(prefix) == []


def test_the_supervisor_frees_what_a_dead_process_held() -> None:
    prefix = _prefix()
    proc = SPAWN.Process(target=_pooling_producer_that_dies, args=(prefix,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and len(our_shm_segments(prefix)) == 3
    supervisor = ShmConnector("serve", SPEC, prefix=prefix)
    assert supervisor.release_process(proc.pid or 0) == 3
    assert our_shm_segments(prefix) == []

    owner = ShmConnector("default", SPEC, prefix=prefix)
    try:
        _, _, h = owner.put("a", "b", "r1", {"x": torch.ones(100_000)})
        reader = _read_in_a_process_that_dies(prefix, h)
        assert supervisor.release_process(reader) == 1
        assert shm_segments_in_use(prefix) == [] and len(our_shm_segments(prefix)) == 1
    finally:
        owner.close()
    assert our_shm_segments(prefix) == []


def test_idle_segments_beyond_the_pool_are_unlinked() -> None:
    prefix = _prefix()
    producer = ShmConnector("default", ConnectorSpec(kind="shm", pool_bytes=0), prefix=prefix)
    try:
        for r, numel in enumerate((100_000, 1_000_000)):
            _, _, h = producer.put("a", "b", f"r{r}", {"x": torch.ones(numel)})
            producer.get("a", "b", f"r{r}", h)
        assert len(our_shm_segments(prefix)) == 1, "the idle small segment made room for the large one"
        assert producer.pooled_bytes() >= 4_000_000
    finally:
        producer.close()
    assert our_shm_segments(prefix) == []


def test_cleanup_leaves_a_segment_being_read_alone() -> None:
    prefix = _prefix()
    producer = ShmConnector("default", SPEC, prefix=prefix)
    try:
        _, _, h = producer.put("a", "b", "r1", {"x": torch.ones(100_000)})
        x = producer.get("a", "b", "r1", h)[0]["x"]
        assert producer.cleanup("r1") == 0
        _, _, h2 = producer.put("a", "b", "r2", {"x": torch.zeros(100_000)})
        assert x.sum().item() == 100_000.0, "a new payload must not land under live tensors"
        assert producer.get("a", "b", "r2", h2)[0]["x"].sum().item() == 0.0
    finally:
        producer.close()
        producer.sweep()


def test_small_payloads_ride_inline() -> None:
    prefix = _prefix()
    conn = ShmConnector("default", SPEC, prefix=prefix)
    ok, _, h = conn.put("a", "b", "r1", {"x": torch.ones(4)})
    assert ok and h.inline is not None and h.key is None
    assert our_shm_segments(prefix) == []
    data, _ = conn.get("a", "b", "r1", h)
    assert data["x"].tolist() == [1.0] * 4


def test_a_handle_for_another_request_is_refused() -> None:
    prefix = _prefix()
    conn = ShmConnector("default", SPEC, prefix=prefix)
    try:
        _, _, h = conn.put("a", "b", "r1", {"x": torch.ones(100_000)})
        for rid in ("r2", "r"):
            with pytest.raises(ConnectorError, match="not one of request"):
                conn.get("a", "b", rid, h)
        assert conn.get("a", "b", "r1", h)[0]["x"].sum().item() == 100_000.0
    finally:
        conn.close()
        conn.sweep()


def test_a_segment_nobody_reads_is_reclaimed_by_its_writer() -> None:
    """The message naming a written segment can be lost with a NATS server, and with it every
    reader's and cleaner's way to it: past any request's life its writer takes it back."""
    prefix = _prefix()
    conn = ShmConnector("t", SPEC, prefix=prefix)
    try:
        _, _, handle = conn.put("a", "b", "r1", {"x": torch.ones(4096)})
        assert conn.reclaim_unread(older_than_s=3600) == 0  # young: its reader may still come
        assert [s for s in our_shm_segments(prefix) if "r1~" in s] != []
        assert conn.reclaim_unread(older_than_s=0) == 1
        assert shm_segments_in_use(prefix) == []  # back in the writer's pool
        with pytest.raises(PayloadGone):
            conn.get("a", "b", "r1", handle)
    finally:
        conn.close()
    assert our_shm_segments(prefix) == []


async def test_closing_leaves_a_connector_call_that_never_ends(caplog: pytest.LogCaptureFixture) -> None:
    """A backend that answers nothing holds each call for its own timeout (Mooncake's is 30 s, for
    every queued call). Closing a process's connector I/O waits a bounded time, then leaves the
    call and the connectors open, so the process can exit (a stage once hung at exit past its
    pod's grace); once the call ends, a second close closes them. The call that never ends is
    a stand-in, held on an event: no backend hangs on cue (a SIGSTOPped mooncake_master hangs
    some calls and answers others at once)."""
    prefix = _prefix()
    conn = ShmConnector("default", SPEC, prefix=prefix)
    io = OffLoop("test", {"default": conn})
    await io.put(conn, "a", "b", "r1", {"x": torch.ones(4096)})
    io.cleanup("r1")  # its request is over: the segment back to the pool, which close unlinks
    assert conn.pooled_bytes() > 0
    running, answer = threading.Event(), threading.Event()

    def a_call_that_waits_for_its_backend() -> bool:
        running.set()
        return answer.wait()

    held = asyncio.ensure_future(io.call(a_call_that_waits_for_its_backend))
    try:
        assert await asyncio.to_thread(running.wait, 30)
        with caplog.at_level(logging.WARNING, "omni.connectors"):
            assert io.close(wait_s=0.2) is False
        assert "connector calls still running after 0.2 s" in caplog.text
        assert conn.pooled_bytes() > 0  # left open: a thread may be inside it
        answer.set()
        assert io.close(wait_s=30.0) is True
        assert await held is True
        assert conn.pooled_bytes() == 0 and our_shm_segments(prefix) == []
    finally:  # failed midway: nothing of this test's may fail another's leak check
        answer.set()
        conn.sweep()
