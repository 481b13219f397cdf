"""The SHM connector across real processes: 0600 segments, zero-copy reads, nothing left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import uuid
from multiprocessing.connection import Connection

import torch

from omni_pipeline import wire
from omni_pipeline.connectors import ShmConnector
from omni_pipeline.spec import ConnectorSpec
from tests.helpers import our_shm_segments, read_handles

SPEC = ConnectorSpec(kind="shm", inline_threshold_bytes=1024)


def _producer(prefix: str, requests: int, out: Connection) -> None:
    conn = ShmConnector("default", SPEC, prefix=prefix)
    for r in range(requests):
        for seq in range(3):
            payload = {"hidden": torch.full((256, 64), float(r * 10 + seq)), "token_ids": torch.arange(256)}
            ok, nbytes, handle = conn.put("thinker", "talker", f"req{r}", payload, seq=seq)
            assert ok and nbytes > 64 * 1024 and handle.key is not None
            out.send_bytes(wire.encode(handle))
    out.close()


def test_put_get_cleanup_across_processes() -> None:
    prefix = f"omni-test{uuid.uuid4().hex[:6]}"
    consumer = ShmConnector("default", SPEC, prefix=prefix)
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=_producer, args=(prefix, 20, writer))
    proc.start()
    writer.close()
    handles = read_handles(reader)
    proc.join(30)
    assert proc.exitcode == 0 and len(handles) == 60

    # Each segment is ours, private to its owner, and named after its request.
    seg = f"/dev/shm/{handles[0].key}"
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
    assert handles[0].key.startswith(f"{prefix}-req0-thinker-talker-")

    # Requests 0..9 are read (each read unlinks its segment), 10..19 are aborted.
    for i, h in enumerate(handles[:30]):
        data, nbytes = consumer.get("thinker", "talker", f"req{i // 3}", h)
        assert nbytes == h.nbytes
        assert data["hidden"][0, 0].item() == float((i // 3) * 10 + i % 3)
        assert torch.equal(data["token_ids"], torch.arange(256))
    assert len(our_shm_segments(prefix)) == 30
    for r in range(10, 20):
        assert consumer.cleanup(f"req{r}") == 3
    assert our_shm_segments(prefix) == []
    assert consumer.live_objects() == 0


def test_read_is_zero_copy_and_name_goes_at_once() -> None:
    prefix = f"omni-test{uuid.uuid4().hex[:6]}"
    conn = ShmConnector("default", SPEC, prefix=prefix)
    _, _, h = conn.put("a", "b", "r1", {"x": torch.ones(100_000)})
    data, _ = conn.get("a", "b", "r1", h)
    assert our_shm_segments(prefix) == []  # unlinked on read; the mapping lives on
    x = data["x"]
    x[0] = 5.0  # a writable view on the mapping, not a copy of it
    assert x.sum().item() == 100_004.0


def test_small_payloads_ride_inline() -> None:
    prefix = f"omni-test{uuid.uuid4().hex[:6]}"
    conn = ShmConnector("default", SPEC, prefix=prefix)
    ok, _, h = conn.put("a", "b", "r1", {"x": torch.ones(4)})
    assert ok and h.inline is not None and h.key is None
    assert our_shm_segments(prefix) == []
    data, _ = conn.get("a", "b", "r1", h)
    assert data["x"].tolist() == [1.0] * 4


def test_sweep_frees_a_crashed_peers_segments() -> None:
    prefix = f"omni-test{uuid.uuid4().hex[:6]}"
    conn = ShmConnector("default", SPEC, prefix=prefix)
    for r in range(5):
        conn.put("a", "b", f"r{r}", {"x": torch.ones(10_000)})
    assert len(our_shm_segments(prefix)) == 5
    assert ShmConnector("other", SPEC, prefix=prefix).sweep() == 5
    assert our_shm_segments(prefix) == []
