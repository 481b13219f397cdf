"""Shared-memory connector: one POSIX shm segment per large payload, for stages on one node.

Segments live in /dev/shm, are created 0600 with O_EXCL, written once (tensor bytes go
straight from the tensor into the mapping), and are unlinked by the consumer as soon as it
has mapped them, so the consumer reads them zero-copy and the name disappears at once.

Names are `<prefix>-<request>-<from>-<to>-<seq>`: the name *is* the tracking. Any process of
the same deployment can free everything a request still holds with `cleanup(request_id)`,
including segments a crashed peer created, and `sweep()` frees the whole deployment's.

(We map /dev/shm files directly instead of multiprocessing.shared_memory because on Python
3.11 its resource tracker unlinks segments it did not create and warns at exit.)
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any, Final

from omni_pipeline import wire
from omni_pipeline.connectors.base import ConnectorError, ConnectorHandle, OmniConnector
from omni_pipeline.spec import ConnectorSpec

SHM_DIR: Final = Path("/dev/shm")
SHM_PREFIX_ENV: Final = "OMNI_SHM_PREFIX"
DEFAULT_PREFIX: Final = "omni"


class ShmConnector(OmniConnector):
    """Shared memory between processes of one deployment, identified by its segment prefix."""

    def __init__(self, name: str, spec: ConnectorSpec, prefix: str | None = None) -> None:
        super().__init__(name, spec)
        self.prefix = prefix or os.environ.get(SHM_PREFIX_ENV) or DEFAULT_PREFIX

    def _path(self, key: str) -> Path:
        if not key.startswith(self.prefix + "-") or "/" in key:
            raise ConnectorError(f"segment {key!r} is not one of ours")
        return SHM_DIR / key

    def _put_frame(
        self, from_stage: str, to_stage: str, request_id: str, seq: int, frame: wire.EncodedFrame
    ) -> str:
        key = f"{self.prefix}-{request_id}-{from_stage}-{to_stage}-{seq}"
        path = SHM_DIR / key
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise ConnectorError(f"segment {key} already exists (sequence reused)") from None
        try:
            os.ftruncate(fd, frame.size)
            with mmap.mmap(fd, frame.size) as mm:
                frame.write_into(memoryview(mm))
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ConnectorError(f"/dev/shm is full ({frame.size} bytes needed)") from exc
            raise
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return key

    def _get_frame(self, request_id: str, handle: ConnectorHandle) -> Any:
        assert handle.key is not None
        path = self._path(handle.key)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConnectorError(f"segment {handle.key} is gone (request cleaned up?)") from None
        try:
            mm = mmap.mmap(fd, handle.nbytes)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)  # the mapping stays valid; the name goes at once
        # Tensors in the result are views on `mm`; it is unmapped when the last one is freed.
        return wire.decode(memoryview(mm))

    def cleanup(self, request_id: str) -> int:
        return _unlink_glob(f"{self.prefix}-{request_id}-*")

    def sweep(self) -> int:
        """Free every segment of this deployment (at shutdown, or after a crash)."""
        return _unlink_glob(f"{self.prefix}-*")

    def live_objects(self) -> int:
        return sum(1 for _ in SHM_DIR.glob(f"{self.prefix}-*"))

    def health(self) -> dict[str, Any]:
        try:
            st = os.statvfs(SHM_DIR)
        except OSError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True, "free_bytes": st.f_bavail * st.f_frsize, "segments": self.live_objects()}


def _unlink_glob(pattern: str) -> int:
    n = 0
    for p in SHM_DIR.glob(pattern):
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n
