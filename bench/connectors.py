"""connectors: put+get throughput of the data plane, against what the machine can do.

One round moves one float32 tensor from this process to a consumer process: put, hand the
small handle over a pipe (NATS's job in a pipeline), get in the consumer, drop the result
(which releases it: a shm segment goes back to its pool, a Mooncake key is already removed),
and the consumer's ack. Throughput is bytes / median round time. For each size the paths take
turns round by round, after warm-up rounds, so drift hits them all alike.

Paths:
- inline, shm, mooncake: our connectors (mooncake: a real mooncake_master and store server
  on TCP loopback). inline stops at 1 MiB, NATS's default max_payload.
- queue_pickle: the copy-based IPC of the seed's v0.3 design, the ndarray pickled through a
  multiprocessing.Queue.
- raw_mooncake: MooncakeDistributedStore.put_from from the tensor's memory, get_into a buffer
  the consumer allocated once, remove; what our mooncake connector wraps.
- memcpy: `dst.copy_(src)` into an already-touched buffer, in one process: the limit.
- clone: `src.clone()`, a copy into fresh memory: what page faults cost.

Ratios (at 64 MiB): shm_64MiB_vs_memcpy (goal >= 0.7), mooncake_64MiB_vs_raw (goal >= 0.8),
shm_64MiB_vs_queue_pickle.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import bars, figure, machine, median, parser, report, rounds, save
from omni_cli.mooncaked import LocalMooncake
from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorHandle, InlineConnector, OmniConnector, ShmConnector
from omni_pipeline.connectors.shm import SHM_PREFIX_ENV
from omni_pipeline.settings import ConnectorSpec

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20, "256MiB": 256 << 20}
CONNECTORS = ("inline", "shm", "mooncake")
PATHS = ("memcpy", "clone", "queue_pickle", "inline", "shm", "raw_mooncake", "mooncake")
SPAWN = mp.get_context("spawn")


INLINE_MAX = 1 << 20  # NATS's default max_payload: a larger inline handle cannot be sent
WARMUP = 2


def rounds_for(nbytes: int) -> int:
    """About 2 GiB moved per path and size, within 8..100 rounds."""
    return max(8, min(100, (2 << 30) // nbytes))


def paths_for(nbytes: int) -> list[str]:
    return [p for p in PATHS if p != "inline" or nbytes <= INLINE_MAX]


def build(kind: str) -> OmniConnector:
    spec = ConnectorSpec(kind=kind, inline_threshold_bytes=1024)  # type: ignore[arg-type]
    if kind == "inline":
        return InlineConnector("bench", spec)
    if kind == "shm":
        return ShmConnector("bench", spec)
    from omni_pipeline.connectors.mooncake import MooncakeConfig, MooncakeConnector

    return MooncakeConnector("bench", spec, "bench", MooncakeConfig.resolve(None))


# --- the consumer processes ------------------------------------------------------------------


def _connector_consumer(kind: str, conn: Connection) -> None:
    connector = build(kind)
    conn.send_bytes(b"ready")
    while msg := conn.recv_bytes():
        rid, handle = wire.decode(msg, tuple[str, ConnectorHandle])
        data, _ = connector.get("producer", "consumer", rid, handle)
        del data
        conn.send_bytes(b"ok")
    connector.close()


def _raw_mooncake_consumer(max_bytes: int, conn: Connection) -> None:
    from omni_pipeline.connectors.mooncake import MooncakeConfig, MooncakeStore

    client = MooncakeStore.acquire(MooncakeConfig.resolve(None))
    store = client.store
    buf = np.empty(max_bytes, dtype=np.uint8)
    buf.fill(0)  # touched, like the producer's tensor
    conn.send_bytes(b"ready")
    while msg := conn.recv_bytes():
        key, nbytes = wire.decode(msg, tuple[str, int])
        if store.get_into(key, buf.ctypes.data, nbytes) != nbytes:
            raise RuntimeError(f"get_into {key} failed")
        store.remove(key, True)
        conn.send_bytes(b"ok")
    client.release()


def _queue_consumer(q: Any, conn: Connection) -> None:
    conn.send_bytes(b"ready")
    while True:
        arr = q.get()
        if arr is None:
            return
        del arr
        conn.send_bytes(b"ok")


class Consumer:
    """A consumer process and the pipe to it."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(*args, child), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv_bytes() != b"ready":
            raise RuntimeError(f"consumer {target.__name__} did not start")

    def roundtrip(self, msg: bytes) -> None:
        self.conn.send_bytes(msg)
        if self.conn.recv_bytes() != b"ok":
            raise RuntimeError("consumer failed")

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send_bytes(b"")
        self.proc.join(30)


# --- one round per path ----------------------------------------------------------------------


class Paths:
    """Every path, each with a function that runs one round of `src` and returns its seconds."""

    def __init__(self, max_bytes: int) -> None:
        self.consumers: dict[str, Consumer] = {}
        self.connectors: dict[str, OmniConnector] = {}
        for kind in CONNECTORS:
            self.connectors[kind] = build(kind)
            self.consumers[kind] = Consumer(_connector_consumer, kind)
        self.consumers["raw_mooncake"] = Consumer(_raw_mooncake_consumer, max_bytes)
        self.queue = SPAWN.Queue(maxsize=1)
        self.consumers["queue_pickle"] = Consumer(_queue_consumer, self.queue)
        from omni_pipeline.connectors.mooncake import MooncakeConfig, MooncakeStore

        self.mooncake = MooncakeStore.acquire(MooncakeConfig.resolve(None))
        self.store = self.mooncake.store
        self.n = 0

    def run(self, path: str, src: torch.Tensor, dst: torch.Tensor) -> float:
        self.n += 1
        t = time.perf_counter()
        if path == "memcpy":
            dst.copy_(src)
        elif path == "clone":
            src.clone()
        elif path == "queue_pickle":
            self.queue.put(src.numpy())
            self.consumers[path].conn.recv_bytes()
        elif path == "raw_mooncake":
            key = f"raw/{self.n}"
            if self.store.put_from(key, src.data_ptr(), src.nbytes) != 0:
                raise RuntimeError("put_from failed")
            self.consumers[path].roundtrip(wire.encode((key, src.nbytes)))
        else:
            rid = f"r{self.n}"
            _, _, handle = self.connectors[path].put("producer", "consumer", rid, {"x": src})
            self.consumers[path].roundtrip(wire.encode((rid, handle)))
        return time.perf_counter() - t

    def close(self) -> None:
        self.queue.put(None)  # the queue consumer stops on this, the others on an empty message
        for c in self.consumers.values():
            c.close()
        for conn in self.connectors.values():
            conn.close()
        self.mooncake.release()  # before the store servers stop


def measure(sizes: dict[str, int], args: Any) -> dict[str, dict[str, float | None]]:
    """GB/s per path and size (None: the path cannot carry that size)."""
    paths = Paths(max(sizes.values()) + (1 << 20))
    out: dict[str, dict[str, float | None]] = {p: dict.fromkeys(sizes) for p in PATHS}
    try:
        for label, nbytes in sizes.items():
            src = torch.rand(nbytes // 4)
            dst = torch.zeros_like(src)
            times: dict[str, list[float]] = {p: [] for p in paths_for(nbytes)}
            for i in range(WARMUP + rounds(rounds_for(nbytes), args)):
                for p in times:
                    dt = paths.run(p, src, dst)
                    if i >= WARMUP:
                        times[p].append(dt)
            for p, ts in times.items():
                out[p][label] = round(nbytes / median(ts) / 1e9, 3)
    finally:
        paths.close()
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    sizes = list(result["gb_per_s"][PATHS[0]])
    series = {p: [result["gb_per_s"][p][s] or 0 for s in sizes] for p in PATHS}
    bars(ax, sizes, series, "GB/s (log)", "put + get across processes, by payload size")
    ax.set_yscale("log")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    os.environ[SHM_PREFIX_ENV] = prefix = f"omni-bench{os.getpid()}"
    with tempfile.TemporaryDirectory() as logs:
        mc = LocalMooncake(Path(logs), store_bytes=1 << 30)
        os.environ.update(mc.env())  # the consumer processes inherit it
        try:
            # --quick: up to the 64 MiB the ratios are taken at
            gbps = measure({k: v for k, v in SIZES.items() if not args.quick or v <= 64 << 20}, args)
        finally:
            mc.stop()
            ShmConnector("bench", ConnectorSpec(), prefix=prefix).sweep()

    def ratio(ours: str, base: str, digits: int = 3) -> float:
        a, b = gbps[ours]["64MiB"], gbps[base]["64MiB"]
        assert a is not None and b is not None
        return round(a / b, digits)

    result = {
        "benchmark": "connectors",
        "machine": machine(),
        "gb_per_s": gbps,
        "ratios": {
            "shm_64MiB_vs_memcpy": ratio("shm", "memcpy"),
            "mooncake_64MiB_vs_raw": ratio("mooncake", "raw_mooncake"),
            "shm_64MiB_vs_queue_pickle": ratio("shm", "queue_pickle", 1),
            "shm_64MiB_vs_clone": ratio("shm", "clone", 2),
        },
    }
    rows = [(f"{p} GB/s", "  ".join(f"{s}={v or '-':>7}" for s, v in gbps[p].items())) for p in PATHS]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("connectors", rows, result, args, plot)


if __name__ == "__main__":
    main()
