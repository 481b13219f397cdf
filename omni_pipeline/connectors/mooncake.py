"""Mooncake connector: payloads in a MooncakeDistributedStore, for stages on different hosts.

Keys are `<pipeline>/<request>/<from>/<to>/<seq>`. A producer encodes the frame into a warm
buffer and `put_from`s it; the consumer `get_into`s a warm buffer of its own (tensors are then
views on it; it goes back to the pool when they are freed) and removes the key at once. A key
that was just read carries a read lease in the store, so removal is forced: the consumer is its
only reader.
`cleanup(request_id)` removes whatever a request still holds, by key prefix, from any process.
A put that no store server can take (none registered, or none with room) waits `PUT_WAIT_S` for
one; what a store server held when the master expired it is gone, and its gets are PayloadGone.
A master or a store server that stops answering (a stalled host) fails the call waiting on it
within `rpcTimeoutMs` / `tcpStatusTimeoutS` (5 s each), not Mooncake's 30 s: a process's
connector calls run one at a time, so each such wait holds every transfer queued behind it.
A call to the master that went unanswered makes `health` say so until one is answered again.

Stage processes are pure clients by default (`globalSegmentSizeBytes: 0`): the store places
an object in any mounted segment, and a segment leaves with its process, so payloads belong in
store servers (`mooncake_client`), not in stages that come and go. One store client per
process serves every mooncake connector of that process. Setting it up
checks the master with a plain TCP connection first: the library would otherwise wait about
90 s on an unreachable master before failing. Traffic stays on the address each client is
given (`MC_TCP_BIND_ADDRESS`, else the local address that routes to the master).

Install: `pip install 'omni-pipeline[mooncake]'` (mooncake-transfer-engine-non-cuda) and the
Debian package libibverbs1; GPU images use the CUDA build, mooncake-transfer-engine.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

from omni_pipeline import wire
from omni_pipeline.connectors.base import ConnectorError, ConnectorHandle, OmniConnector, PayloadGone
from omni_pipeline.connectors.buffers import BufferPool
from omni_pipeline.environment import MOONCAKE_MASTER_ENV as MASTER_ENV
from omni_pipeline.environment import MOONCAKE_METADATA_ENV as METADATA_ENV
from omni_pipeline.settings import ConnectorSpec, MooncakeSpec

log = logging.getLogger(__name__)

BIND_ENV: Final = "MC_TCP_BIND_ADDRESS"
RPC_TIMEOUT_ENV: Final = "MC_RPC_TIMEOUT_MS"
TCP_STATUS_TIMEOUT_ENV: Final = "MC_TCP_STATUS_TIMEOUT_SEC"
_NOT_FOUND: Final = -704
_RPC_FAIL: Final = -900
_RPC_TIMEOUT: Final = -901
_NO_AVAILABLE_HANDLE: Final = -200
PUT_WAIT_S: Final = 10.0
"""How long a put waits for a store server to take it (NO_AVAILABLE_HANDLE). A store server whose
heartbeats the master missed for its client TTL (10 s; a stalled host) has its segment unmounted
and mounts it again at its next heartbeat, a second after it is back; a full one has room again
once consumers read. Waiting holds the process's connector thread, so it is bounded."""
HEALTH_TIMEOUT_S: Final = 1.0
"""How long a health check waits for the master to accept a connection."""
_HEALTH: Final = {0: "healthy", 1: "not initialised or closed", 2: "master unreachable"}
_ERRORS: Final = {  # Mooncake's ErrorCode (types.h): the ones a transfer meets in practice
    -200: "NO_AVAILABLE_HANDLE: no store server has room or is registered",
    -704: "OBJECT_NOT_FOUND",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL: the master did not answer (down or restarted)",
    -901: "RPC_TIMEOUT",
}


def _error(code: int) -> str:
    return f"code {code} ({_ERRORS[code]})" if code in _ERRORS else f"code {code}"


@dataclass(frozen=True)
class MooncakeConfig:
    master: str
    metadata: str
    protocol: str = "tcp"
    device: str = ""
    global_segment_size: int = 0
    local_buffer_size: int = 64 << 20
    rpc_timeout_ms: int = 5000
    tcp_status_timeout_s: int = 5

    @classmethod
    def resolve(cls, spec: MooncakeSpec | None) -> MooncakeConfig:
        """spec.mooncake, with OMNI_MOONCAKE_MASTER / OMNI_MOONCAKE_METADATA and Mooncake's own
        MC_RPC_TIMEOUT_MS / MC_TCP_STATUS_TIMEOUT_SEC taking precedence."""
        spec = spec or MooncakeSpec()
        master = os.environ.get(MASTER_ENV) or spec.master_server_address
        metadata = os.environ.get(METADATA_ENV) or spec.metadata_server
        if not master or not metadata:
            raise ConnectorError(
                f"a mooncake connector needs the master and metadata addresses: set spec.mooncake "
                f"(masterServerAddress, metadataServer) or {MASTER_ENV} / {METADATA_ENV}"
            )
        return cls(
            master,
            metadata,
            spec.protocol,
            spec.device_name,
            spec.global_segment_size_bytes,
            spec.local_buffer_size_bytes,
            int(os.environ.get(RPC_TIMEOUT_ENV) or spec.rpc_timeout_ms),
            int(os.environ.get(TCP_STATUS_TIMEOUT_ENV) or spec.tcp_status_timeout_s),
        )


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConnectorError(f"Mooncake master address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _local_address_towards(host: str, port: int) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: no packet is sent, the kernel only picks a route
        return str(s.getsockname()[0])


class MooncakeStore:
    """The process's store client, set up once, closed when its last connector closes."""

    _lock = threading.Lock()
    _instances: dict[MooncakeConfig, MooncakeStore] = {}

    def __init__(self, config: MooncakeConfig) -> None:
        host, port = _host_port(config.master)
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError as exc:
            raise ConnectorError(f"Mooncake master at {config.master} unreachable: {exc}") from None
        os.environ.setdefault("GLOG_minloglevel", "1")  # the library's INFO lines drown ours
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            hint = "pip install 'omni-pipeline[mooncake]' and apt-get install libibverbs1"
            raise ConnectorError(f"mooncake is not installed ({exc}): {hint}") from None
        local = os.environ.get(BIND_ENV) or _local_address_towards(host, port)
        os.environ[BIND_ENV] = local  # keep the transfer engine on this address
        # Read as the client is set up: a call that gets no answer fails within these.
        os.environ[RPC_TIMEOUT_ENV] = str(config.rpc_timeout_ms)
        os.environ[TCP_STATUS_TIMEOUT_ENV] = str(config.tcp_status_timeout_s)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            local,
            config.metadata,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device,
            config.master,
        )
        if rc != 0:
            raise ConnectorError(
                f"Mooncake setup failed (code {rc}): master {config.master}, metadata {config.metadata}"
            )
        self.config = config
        self.users = 0
        self.unanswered: str | None = None
        """What the last call to the master that went unanswered got (RPC_TIMEOUT), until one
        is answered again: `health` says so, a stalled master's kernel still taking connections."""

    def heard(self, rc: int) -> int:
        """Note how a call that asks the master ended (`rc`, returned): unanswered, or answered
        (any other end but a refused connection, which `health` sees by itself)."""
        if rc == _RPC_TIMEOUT:
            self.unanswered = _error(rc)
        elif rc != _RPC_FAIL:
            self.unanswered = None
        return rc

    @classmethod
    def acquire(cls, config: MooncakeConfig) -> MooncakeStore:
        with cls._lock:
            inst = cls._instances.get(config)
            if inst is None:
                inst = cls._instances[config] = cls(config)
            inst.users += 1
            return inst

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                self._instances.pop(self.config, None)
                self.store.close()


class MooncakeConnector(OmniConnector):
    def __init__(self, name: str, spec: ConnectorSpec, pipeline: str, config: MooncakeConfig) -> None:
        super().__init__(name, spec)
        self.pipeline = pipeline
        self._store = MooncakeStore.acquire(config)
        self._buffers = BufferPool(spec.pool_bytes)
        self._written: dict[str, set[str]] = {}
        """Keys put here, by request, until seen gone or freed: what `free_written` frees, and
        what the leak gauge counts."""
        self._written_lock = threading.Lock()
        self._closed = False

    def _put_frame(
        self, from_stage: str, to_stage: str, request_id: str, seq: int, frame: wire.EncodedFrame
    ) -> str:
        key = f"{self.pipeline}/{request_id}/{from_stage}/{to_stage}/{seq}"
        buf = self._buffers.take(frame.size)  # put_from has copied it out when it returns
        try:
            frame.write_into(memoryview(buf))
            rc = self._put_waiting_for_room(key, buf.ctypes.data, frame.size)
        finally:
            self._buffers.give(buf)
        if rc != 0:
            raise ConnectorError(f"Mooncake put of {key} ({frame.size} bytes) failed with {_error(rc)}")
        with self._written_lock:
            self._written.setdefault(request_id, set()).add(key)
        return key

    def _put_waiting_for_room(self, key: str, address: int, size: int) -> int:
        """put_from, tried again for up to `PUT_WAIT_S` while no store server can take it."""
        deadline = time.monotonic() + PUT_WAIT_S
        pause = 0.05
        while True:
            rc = self._store.heard(int(self._store.store.put_from(key, address, size)))
            if rc != _NO_AVAILABLE_HANDLE or time.monotonic() + pause > deadline:
                return rc
            log.info("Mooncake put of %s: no store server can take it yet; trying again", key)
            time.sleep(pause)  # a backoff: the store server's return is seen by no event of ours
            pause = min(2 * pause, 1.0)

    def _get_frame(self, request_id: str, handle: ConnectorHandle) -> Any:
        key = handle.key
        assert key is not None
        if not self._of_request(key, request_id):
            raise ConnectorError(f"key {key!r} does not belong to request {request_id}")
        buf = self._buffers.lease(handle.nbytes)
        n = self._store.heard(int(self._store.store.get_into(key, buf.ctypes.data, handle.nbytes)))
        if n != handle.nbytes:
            gone = n == _NOT_FOUND
            raise (PayloadGone if gone else ConnectorError)(f"Mooncake get of {key} failed with {_error(n)}")
        self._remove(key)
        return wire.decode(memoryview(buf))

    def _of_request(self, key: str, request_id: str) -> bool:
        return key.startswith(f"{self.pipeline}/{request_id}/")

    def _remove(self, key: str) -> None:
        """Remove one key, forced (a read's fresh lease refuses a plain removal); a failure is
        logged, and the gateway's cleanup may free the key yet."""
        rc = self._store.heard(int(self._store.store.remove(key, True)))
        if rc not in (0, _NOT_FOUND):
            log.warning("Mooncake remove of %s failed with code %d", key, rc)

    def cleanup(self, request_id: str) -> int:
        """Every key of the request: the master matches the pattern against every key it holds,
        a search of the whole store (0.75 us a key, 2026-12-07), so only the gateway, once for a
        request that ended short, frees this way; replicas free what they wrote."""
        with self._written_lock:
            self._written.pop(request_id, None)
        pattern = f"^{re.escape(self.pipeline)}/{re.escape(request_id)}/"
        return max(0, self._store.heard(int(self._store.store.remove_by_regex(pattern, True))))

    def free_written(self, request_id: str) -> int:
        """The keys this process put for the request, by name: nothing asked of the master
        where there are none (most replicas, for most requests)."""
        with self._written_lock:
            keys = sorted(self._written.pop(request_id, ()))
        if not keys:
            return 0
        codes = [int(c) for c in self._store.store.batch_remove(keys, True)]
        self._store.heard(min(codes))
        failed = {k: c for k, c in zip(keys, codes, strict=True) if c not in (0, _NOT_FOUND)}
        if failed:  # still counted by the leak gauge; the gateway's cleanup may free them yet
            why = _error(next(iter(failed.values())))
            log.warning("Mooncake remove of %d keys of %s failed (%s)", len(failed), request_id, why)
            with self._written_lock:
                self._written.setdefault(request_id, set()).update(failed)
        return codes.count(0)

    def discard(self, request_id: str, handle: ConnectorHandle) -> None:
        if handle.key is not None and self._of_request(handle.key, request_id):
            self._remove(handle.key)

    def live_objects(self) -> int:
        """Keys this process put that are still in the store (their consumer removes them).
        Counted at every heartbeat: with none to count, the master is still asked while its
        last call went unanswered, so that `health` hears it answer again."""
        with self._written_lock:
            keys = [key for held in self._written.values() for key in held]
        if not keys:
            if self._store.unanswered is not None:
                self._store.heard(int(self._store.store.is_exist(f"{self.pipeline}/health")))
            return 0
        exists = [int(e) for e in self._store.store.batch_is_exist(keys)]
        self._store.heard(min(exists))
        gone = {k for k, e in zip(keys, exists, strict=True) if e == 0}
        with self._written_lock:
            for request_id, held in list(self._written.items()):
                held -= gone
                if not held:
                    del self._written[request_id]
            return sum(map(len, self._written.values()))

    def pooled_bytes(self) -> int:
        return self._buffers.idle()

    def health(self) -> dict[str, Any]:
        """The client's own state, whether the master takes a connection now, and whether it
        answered the last call made to it: the client keeps saying "healthy" long after its
        master has gone, and a stalled master's kernel still takes connections."""
        master = self._store.config.master
        rc = int(self._store.store.health_check())
        if rc != 0:
            return {"ok": False, "status": _HEALTH.get(rc, f"code {rc}"), "master": master}
        try:
            socket.create_connection(_host_port(master), timeout=HEALTH_TIMEOUT_S).close()
        except OSError as exc:
            return {"ok": False, "status": f"master {master} unreachable ({exc})", "master": master}
        if (silent := self._store.unanswered) is not None:
            return {"ok": False, "status": f"master {master} does not answer ({silent})", "master": master}
        return {"ok": True, "status": "healthy", "master": master}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.release()
