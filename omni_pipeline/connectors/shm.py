"""Shared-memory connector: a pool of warm, reused POSIX shm segments, for stages on one node.

Why a pool: a copy into a fresh segment page-faults on every page, several times slower than
a copy into memory that is already mapped and touched. So a producer keeps the segments it
made, mapped, and reuses them; a consumer keeps its mappings of them. A payload costs one copy
into warm pages, and the consumer reads it zero-copy.

A segment's state is its name in /dev/shm, and each change of state is one atomic rename, so
two processes can never claim one segment and any process can see who holds what:

    <prefix>-@busy-<owner>-<n>                          its owner is writing it
    <prefix>-<request>~<from>-<to>-<seq>@<owner>-<n>    written, waiting for its consumer
    <prefix>-@held-<owner>-<n>-<reader>                 read: the reader's tensors are views on it
    <prefix>-@free-<owner>-<n>                          its owner may reuse it

`owner` and `reader` are process ids and `n` numbers the owner's segments. Segments are
created 0600 with O_EXCL. A held segment goes back to free when the reader's last tensor on it
is freed (a weakref.finalize on the lease), so a reader may keep or even write its tensors for
as long as it likes. Every state has an owner that ends it: `cleanup(request_id)`, from any
process, returns a request's unread segments to their owners (or unlinks them when the owner
is gone); an owner takes back its written segments that no reader took for longer than any
request lives (`reclaim_unread`: the message naming one was lost with a NATS server), and
segments whose reader died; free segments beyond `poolBytes` are unlinked, least recently
used first; an owner unlinks its segments when it closes, a
reader's release unlinks a segment whose owner is gone; a supervisor calls
`release_process(pid)` for a child that died, and `sweep()` at shutdown.

(We map /dev/shm files directly instead of multiprocessing.shared_memory because on Python
3.11 its resource tracker unlinks segments it did not create and warns at exit.)
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from omni_pipeline import wire
from omni_pipeline.connectors.base import ConnectorError, ConnectorHandle, OmniConnector, PayloadGone
from omni_pipeline.connectors.buffers import capacities_for, capacity_class
from omni_pipeline.settings import ConnectorSpec

SHM_DIR: Final = Path("/dev/shm")
_DIR: Final = f"{SHM_DIR}/"
SHM_PREFIX_ENV: Final = "OMNI_SHM_PREFIX"
DEFAULT_PREFIX: Final = "omni"

_READER_MAPPINGS: Final = 64  # mappings of other processes' segments a reader keeps
_WRITTEN: Final = re.compile(r"@(\d+)-(\d+)$")  # a written segment's name ends in @<owner>-<n>
_HELD: Final = re.compile(r"-@held-\d+-(\d+)-(\d+)$")  # ... <n>-<reader>
_segment_numbers = itertools.count()  # per process, so connectors sharing a prefix never collide


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(eq=False)
class _Segment:
    """One of this process's own segments, mapped for writing."""

    n: int
    capacity: int
    mm: mmap.mmap
    last_used: int = 0


@dataclass(eq=False)
class _Mapping:
    """A reader's mapping of another process's segment; `fd` tells when the segment is gone."""

    ino: int
    fd: int
    mm: mmap.mmap


class _ReaderMappings:
    """A reader's mappings of other processes' segments, kept (the most recent, a bounded
    number) so that a segment read again is not mapped again; the caller holds the lock."""

    def __init__(self) -> None:
        self._by_segment: OrderedDict[tuple[int, int], _Mapping] = OrderedDict()

    def get(self, held: str, owner: int, n: int) -> mmap.mmap:
        """The mapping of segment `n` of `owner`, by its held name: the kept one while it is
        the same file, else a new one."""
        st = os.stat(held)
        cached = self._by_segment.get((owner, n))
        if cached is not None and cached.ino == st.st_ino:
            self._by_segment.move_to_end((owner, n))
            return cached.mm
        self._drop_stale()
        fd = os.open(held, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        self._by_segment[(owner, n)] = _Mapping(st.st_ino, fd, mm)
        while len(self._by_segment) > _READER_MAPPINGS:
            _, old = self._by_segment.popitem(last=False)
            os.close(old.fd)
        return mm

    def _drop_stale(self) -> None:
        """Unmapped segments their owner unlinked: our mapping alone would keep their memory."""
        for key, mp in list(self._by_segment.items()):
            if os.fstat(mp.fd).st_nlink == 0:
                del self._by_segment[key]
                os.close(mp.fd)

    def close(self) -> None:
        for mp in self._by_segment.values():
            os.close(mp.fd)
        self._by_segment.clear()


class ShmConnector(OmniConnector):
    """Shared memory between processes of one deployment, identified by its segment prefix."""

    def __init__(self, name: str, spec: ConnectorSpec, prefix: str | None = None) -> None:
        super().__init__(name, spec)
        self.prefix = prefix or os.environ.get(SHM_PREFIX_ENV) or DEFAULT_PREFIX
        self.pool_bytes = spec.pool_bytes
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._uses = 0
        self._readers = _ReaderMappings()

    # --- names ---------------------------------------------------------------------------------

    # Plain strings, not Paths: pathlib costs as much as the syscalls on the per-payload path.

    def _state(self, state: str, owner: int, n: int) -> str:
        return f"{_DIR}{self.prefix}-@{state}-{owner}-{n}"

    def _held(self, owner: int, n: int) -> str:
        return f"{_DIR}{self.prefix}-@held-{owner}-{n}-{self._pid}"

    # --- producer ------------------------------------------------------------------------------

    def _put_frame(
        self, from_stage: str, to_stage: str, request_id: str, seq: int, frame: wire.EncodedFrame
    ) -> str:
        seg = self._claim(frame.size)
        busy = self._state("busy", self._pid, seg.n)
        key = f"{self.prefix}-{request_id}~{from_stage}-{to_stage}-{seq}@{self._pid}-{seg.n}"
        try:
            with memoryview(seg.mm) as out:
                frame.write_into(out)
        except BaseException:
            os.rename(busy, self._state("free", self._pid, seg.n))
            raise
        os.rename(busy, _DIR + key)  # the name is new: it ends in this segment's own number
        return key

    def _claim(self, size: int) -> _Segment:
        """A segment of ours, at least `size` bytes, renamed busy: a warm free one if we have one."""
        with self._lock:
            self._uses += 1
            if (seg := self._claim_free(size)) is not None:
                return seg
            self._reap()
            if (seg := self._claim_free(size)) is not None:
                return seg
            capacity = capacity_class(size)
            self._trim(self.pool_bytes - capacity)
            try:
                seg = self._create(capacity)
            except ConnectorError:
                self._trim(0)  # our idle segments may be what fills /dev/shm
                seg = self._create(capacity)
            seg.last_used = self._uses
            return seg

    def _claim_free(self, size: int) -> _Segment | None:
        fitting = capacities_for(size)
        candidates = sorted(
            (s for s in self._segments.values() if s.capacity in fitting), key=lambda s: s.capacity
        )
        for seg in candidates:
            try:
                os.rename(self._state("free", self._pid, seg.n), self._state("busy", self._pid, seg.n))
            except FileNotFoundError:
                continue  # in use
            seg.last_used = self._uses
            return seg
        return None

    def _create(self, capacity: int) -> _Segment:
        n = next(_segment_numbers)
        path = self._state("busy", self._pid, n)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, capacity)
            mm = mmap.mmap(fd, capacity)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ConnectorError(f"/dev/shm is full ({capacity} bytes needed)") from exc
            raise
        finally:
            os.close(fd)
        seg = self._segments[n] = _Segment(n, capacity, mm)
        return seg

    def _trim(self, keep_bytes: int) -> None:
        """Unlink free segments, least recently used first, until we own at most `keep_bytes`."""
        owned = sum(s.capacity for s in self._segments.values())
        for seg in sorted(self._segments.values(), key=lambda s: s.last_used):
            if owned <= keep_bytes:
                return
            try:
                os.unlink(self._state("free", self._pid, seg.n))
            except FileNotFoundError:
                continue  # in use
            owned -= seg.capacity
            self._forget(seg)

    def _forget(self, seg: _Segment) -> None:
        del self._segments[seg.n]
        with contextlib.suppress(BufferError):  # our own reader still has views; GC unmaps it
            seg.mm.close()

    def _reap(self) -> None:
        """Take back our segments whose reader died holding them."""
        for path in SHM_DIR.glob(f"{self.prefix}-@held-{self._pid}-*"):
            m = _HELD.search(path.name)
            if m and not _alive(int(m.group(2))):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, self._state("free", self._pid, int(m.group(1))))

    # --- consumer ------------------------------------------------------------------------------

    def _get_frame(self, request_id: str, handle: ConnectorHandle) -> Any:
        key = handle.key
        assert key is not None
        m = _WRITTEN.search(key)
        if not key.startswith(f"{self.prefix}-{request_id}~") or "/" in key or m is None:
            raise ConnectorError(f"segment {key!r} is not one of request {request_id}'s")
        owner, n = int(m.group(1)), int(m.group(2))
        held = self._held(owner, n)
        try:
            os.rename(_DIR + key, held)
        except FileNotFoundError:
            raise PayloadGone(f"segment {key} is gone (request cleaned up?)") from None
        try:
            mm = self._mapping(held, owner, n)
            if len(mm) < handle.nbytes:
                raise ConnectorError(f"segment {key} is smaller than its handle says")
            lease = np.frombuffer(mm, dtype=np.uint8, count=handle.nbytes)
        except BaseException:
            _release(held, self._state("free", owner, n), owner)
            raise
        # Tensors in the result are views on `lease`; the segment is free again once they are gone.
        weakref.finalize(lease, _release, held, self._state("free", owner, n), owner)
        return wire.decode(memoryview(lease))

    def _mapping(self, held: str, owner: int, n: int) -> mmap.mmap:
        with self._lock:
            if owner == self._pid and (own := self._segments.get(n)) is not None:
                return own.mm
            return self._readers.get(held, owner, n)

    # --- requests and the deployment -----------------------------------------------------------

    def cleanup(self, request_id: str) -> int:
        n_freed = 0
        # `~` ends the id (ids cannot hold it): request `r` is not `r-1`, its retry.
        for path in SHM_DIR.glob(f"{self.prefix}-{request_id}~*"):
            m = _WRITTEN.search(path.name)
            if m is None:
                continue
            owner = int(m.group(1))
            try:
                if _alive(owner):
                    os.rename(path, self._state("free", owner, int(m.group(2))))
                else:
                    path.unlink()
            except FileNotFoundError:
                continue  # read or cleaned up just now
            n_freed += 1
        return n_freed

    def reclaim_unread(self, older_than_s: float) -> int:
        """Our written segments that waited longer than `older_than_s` for their reader (a
        rename sets a segment's ctime: when it was written) go back to our pool."""
        n = 0
        oldest = time.time() - older_than_s
        for path in SHM_DIR.glob(f"{self.prefix}-*~*@{self._pid}-*"):
            m = _WRITTEN.search(path.name)
            if m is None or int(m.group(1)) != self._pid:
                continue
            with contextlib.suppress(FileNotFoundError):  # read or cleaned up just now
                if path.stat().st_ctime < oldest:
                    os.rename(path, self._state("free", self._pid, int(m.group(2))))
                    n += 1
        return n

    def release_process(self, pid: int) -> int:
        """What a dead process of the deployment held (its supervisor calls this once it is reaped):
        its idle segments are unlinked and the ones it was reading go back to their owners."""
        n = 0
        for path in SHM_DIR.glob(f"{self.prefix}-@*"):
            state, owner, seg, *reader = path.name[len(self.prefix) + 2 :].split("-")
            with contextlib.suppress(FileNotFoundError, ValueError):
                if state in ("free", "busy") and int(owner) == pid:
                    path.unlink()
                elif state == "held" and reader and int(reader[0]) == pid:
                    _release(str(path), self._state("free", int(owner), int(seg)), int(owner))
                else:
                    continue
                n += 1
        return n

    def sweep(self) -> int:
        """Unlink every segment of this deployment (at shutdown, or after a crash)."""
        n = 0
        for p in SHM_DIR.glob(f"{self.prefix}-*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
        return n

    def live_objects(self) -> int:
        """Segments in use by some request (written, held or being written): free ones are idle."""
        return sum(1 for p in SHM_DIR.glob(f"{self.prefix}-*") if "-@free-" not in p.name)

    def pooled_bytes(self) -> int:
        """Shared memory this process owns, in use or free."""
        return sum(s.capacity for s in list(self._segments.values()))  # a snapshot: health() runs in a thread

    def health(self) -> dict[str, Any]:
        try:
            st = os.statvfs(SHM_DIR)
        except OSError as exc:
            return {"ok": False, "error": str(exc)}
        return {
            "ok": True,
            "free_bytes": st.f_bavail * st.f_frsize,
            "segments": self.live_objects(),
            "pooled_bytes": self.pooled_bytes(),
        }

    def close(self) -> None:
        """Give back what this process still reads (the process is ending: its tensors' release
        would come from finalizers an exit without teardown does not run), then unlink our free
        and busy segments; ours still in use go when their reader lets go."""
        with self._lock:
            for path in SHM_DIR.glob(f"{self.prefix}-@held-*-*-{self._pid}"):
                owner, n = path.name[len(self.prefix) + len("-@held-") :].split("-")[:2]
                _release(str(path), self._state("free", int(owner), int(n)), int(owner))
            for seg in list(self._segments.values()):
                for state in ("free", "busy"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._state(state, self._pid, seg.n))
                self._forget(seg)
            self._readers.close()


def _release(held: str, free: str, owner: int) -> None:
    """A reader is done with a segment: back to its owner, or gone if the owner is."""
    with contextlib.suppress(FileNotFoundError):  # swept at shutdown
        if _alive(owner):
            os.rename(held, free)
        else:
            os.unlink(held)
