"""The wire format: msgpack (msgspec) with tensors and ndarrays framed out of band. Never pickle.

A frame is one contiguous buffer:

    b"OMW1" | u32 reserved | u64 header_len | u64 data_len | header (msgpack) | pad | data

Tensors and ndarrays inside the header are msgpack extension values holding (dtype, shape,
offset, nbytes) into `data`, each buffer 64-byte aligned. This lets a connector write a
tensor's bytes exactly once, straight into shared memory (`frame_size` + `write_frame`), and
lets the reader build tensors as views on the frame without copying (`decode`).

Ownership: a decoded tensor is a view on the buffer passed to `decode` and keeps that buffer
alive for as long as the tensor lives. Pass a writable buffer (bytearray, a writable mmap) if
the consumer may write to the tensor; `decode` of immutable `bytes` copies them first.

Only extension codes 1 (torch tensor) and 2 (numpy ndarray) exist; any other code, an object
dtype, or a malformed frame raises WireError.

torch is imported only when a tensor is met: the operator and the CLI speak this wire format
for control messages alone and start without it.
"""

from __future__ import annotations

import functools
import struct
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

MAGIC: Final = b"OMW1"
_PREAMBLE = struct.Struct("<4sIQQ")
_EXT_HEAD = struct.Struct("<BBQQ")  # dtype code, ndim, offset, nbytes; then ndim x int64 dims
ALIGN: Final = 64
_PARALLEL_COPY_BYTES: Final = 1 << 20

EXT_TENSOR: Final = 1
EXT_NDARRAY: Final = 2

_TORCH_DTYPE_NAMES: Final = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
"""Tensor dtype codes, in order."""
_NUMPY_DTYPES: Final[list[np.dtype[Any]]] = [
    np.dtype(t) for t in ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
]
_NUMPY_CODE = {d: i for i, d in enumerate(_NUMPY_DTYPES)}

T = TypeVar("T")


class WireError(ValueError):
    """A payload that is not a valid omni-pipeline frame; it is refused, never guessed at."""


@functools.cache
def _torch_dtypes() -> tuple[list[torch.dtype], dict[torch.dtype, int]]:
    """Tensor dtypes by code, and codes by dtype (torch imported here, the first time a tensor
    is encoded or decoded)."""
    import torch

    dtypes = [getattr(torch, name) for name in _TORCH_DTYPE_NAMES]
    return dtypes, {d: i for i, d in enumerate(dtypes)}


def _is_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor, without importing torch (no tensor exists before it is)."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(obj, torch_module.Tensor)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class EncodedFrame:
    """A frame ready to be written: the header plus the raw buffers it points into."""

    __slots__ = ("buffers", "header", "size")

    def __init__(self, header: bytes, buffers: list[tuple[int, memoryview]], data_len: int) -> None:
        self.header = header
        self.buffers = buffers
        self.size = _align(_PREAMBLE.size + len(header)) + data_len

    def write_into(self, out: memoryview) -> int:
        """Write the frame into `out` (at least `size` bytes); each tensor byte is copied once."""
        hdr_end = _PREAMBLE.size + len(self.header)
        data_start = _align(hdr_end)
        _PREAMBLE.pack_into(out, 0, MAGIC, 0, len(self.header), self.size - data_start)
        out[_PREAMBLE.size : hdr_end] = self.header
        for offset, buf in self.buffers:
            start = data_start + offset
            if buf.nbytes < _PARALLEL_COPY_BYTES:
                out[start : start + buf.nbytes] = buf
            else:  # torch copies on its intra-op threads; a memoryview copy is one thread
                import torch

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only source buffers
                    dst = torch.frombuffer(out, dtype=torch.uint8, count=buf.nbytes, offset=start)
                    dst.copy_(torch.frombuffer(buf, dtype=torch.uint8))
        return self.size

    def to_bytes(self) -> bytearray:
        out = bytearray(self.size)
        self.write_into(memoryview(out))
        return out


class _Packer:
    """Collects tensor buffers while msgspec encodes the header; one per encode call."""

    def __init__(self) -> None:
        self.buffers: list[tuple[int, memoryview]] = []
        self.data_len = 0
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self.hook)

    def _add(self, raw: memoryview) -> int:
        offset = self.data_len
        self.buffers.append((offset, raw))
        self.data_len = _align(offset + raw.nbytes)
        return offset

    def hook(self, obj: Any) -> Any:
        if _is_tensor(obj):
            import torch

            code = _torch_dtypes()[1].get(obj.dtype)
            if code is None:
                raise WireError(f"tensor dtype {obj.dtype} cannot go on the wire")
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            raw = memoryview(flat.numpy()).cast("B") if flat.numel() else memoryview(b"")
            return msgspec.msgpack.Ext(
                EXT_TENSOR, _ext_head(code, tuple(t.shape), self._add(raw), raw.nbytes)
            )
        if isinstance(obj, np.ndarray):
            code = _NUMPY_CODE.get(obj.dtype)
            if code is None:
                raise WireError(f"ndarray dtype {obj.dtype} cannot go on the wire")
            arr = np.ascontiguousarray(obj)
            raw = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
            return msgspec.msgpack.Ext(EXT_NDARRAY, _ext_head(code, arr.shape, self._add(raw), raw.nbytes))
        raise WireError(f"type {type(obj).__name__} cannot go on the wire")


def _ext_head(code: int, shape: tuple[int, ...], offset: int, nbytes: int) -> bytes:
    return _EXT_HEAD.pack(code, len(shape), offset, nbytes) + struct.pack(f"<{len(shape)}q", *shape)


class Clock:
    """Seconds this process has spent encoding and decoding frames (control messages and
    payloads alike), for its /metrics: where a stage's time goes. Each thread adds to a tally
    of its own, so no lock is ever taken on the way (nothing to deadlock, nothing to contend)."""

    def __init__(self) -> None:
        self._mine = threading.local()
        self._tallies: list[dict[str, float]] = []

    def add(self, op: str, seconds: float) -> None:
        tally = getattr(self._mine, "tally", None)
        if tally is None:
            tally = self._mine.tally = {"encode": 0.0, "decode": 0.0}
            self._tallies.append(tally)  # kept when its thread ends: totals never go back
        tally[op] += seconds

    @property
    def seconds(self) -> dict[str, float]:
        tallies = list(self._tallies)
        return {op: sum(t[op] for t in tallies) for op in ("encode", "decode")}


CLOCK: Final = Clock()


def encode_frame(obj: Any) -> EncodedFrame:
    """Encode `obj` (msgspec Structs, dicts, lists, scalars, tensors, ndarrays) as a frame."""
    t = time.perf_counter()
    try:
        return _encode_frame(obj)
    finally:
        CLOCK.add("encode", time.perf_counter() - t)


def _encode_frame(obj: Any) -> EncodedFrame:
    packer = _Packer()
    try:
        header = packer.encoder.encode(obj)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode: {exc}") from exc
    return EncodedFrame(header, packer.buffers, packer.data_len)


def payload_nbytes(obj: Any) -> int:
    """The tensor, ndarray and text bytes `obj` holds (structs, dicts and lists walked): about
    its frame's size, without encoding it."""
    if isinstance(obj, msgspec.Struct):
        return sum(payload_nbytes(getattr(obj, f)) for f in obj.__struct_fields__)
    if isinstance(obj, dict):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(payload_nbytes(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if _is_tensor(obj):
        return int(obj.numel() * obj.element_size())
    return len(obj) if isinstance(obj, str | bytes) else 0


def encode(obj: Any) -> bytes:
    """Encode `obj` into one buffer (tensor bytes copied once)."""
    return bytes(encode_frame(obj).to_bytes())


# --- decoding --------------------------------------------------------------------------------

_tls = threading.local()


def _ext_hook(code: int, data: memoryview) -> Any:
    frame_data: memoryview = _tls.data
    if code not in (EXT_TENSOR, EXT_NDARRAY):
        raise WireError(f"unknown extension type {code}")
    if len(data) < _EXT_HEAD.size:
        raise WireError("truncated tensor header")
    dcode, ndim, offset, nbytes = _EXT_HEAD.unpack_from(data, 0)
    if len(data) != _EXT_HEAD.size + 8 * ndim:
        raise WireError("malformed tensor header")
    shape = struct.unpack_from(f"<{ndim}q", data, _EXT_HEAD.size)
    if any(d < 0 for d in shape) or offset + nbytes > len(frame_data):
        raise WireError("tensor outside its frame")
    raw = frame_data[offset : offset + nbytes]
    if code == EXT_TENSOR:
        import torch

        dtypes = _torch_dtypes()[0]
        if dcode >= len(dtypes):
            raise WireError(f"unknown tensor dtype code {dcode}")
        dtype = dtypes[dcode]
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if numel * dtype.itemsize != nbytes:
            raise WireError("tensor size does not match its shape")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers: documented above
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    if dcode >= len(_NUMPY_DTYPES):
        raise WireError(f"unknown ndarray dtype code {dcode}")
    ndt = _NUMPY_DTYPES[dcode]
    if int(np.prod(shape, dtype=np.int64)) * ndt.itemsize != nbytes:
        raise WireError("ndarray size does not match its shape")
    return np.frombuffer(raw, dtype=ndt).reshape(shape)


_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def _decoder(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.msgpack.Decoder(type_, ext_hook=_ext_hook)
    return dec


def decode(buf: bytes | bytearray | memoryview, type_: type[T] | Any = Any) -> T:
    """Decode a frame into `type_`; tensors are views on `buf` (see the module docstring)."""
    t = time.perf_counter()
    try:
        return _decode(buf, type_)
    finally:
        CLOCK.add("decode", time.perf_counter() - t)


def _decode(buf: bytes | bytearray | memoryview, type_: type[T] | Any) -> T:
    if isinstance(buf, bytes):
        buf = bytearray(buf)  # tensors must not alias immutable memory
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREAMBLE.size:
        raise WireError("frame too short")
    magic, _, header_len, data_len = _PREAMBLE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise WireError("not an omni-pipeline frame (bad magic)")
    hdr_end = _PREAMBLE.size + header_len
    data_start = _align(hdr_end)
    if data_start + data_len > len(mv):
        raise WireError("frame truncated")
    _tls.data = mv[data_start : data_start + data_len]
    try:
        return _decoder(type_).decode(mv[_PREAMBLE.size : hdr_end])
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid message: {exc}") from exc
    except msgspec.DecodeError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, WireError):
            raise cause from None
        raise WireError(f"undecodable frame: {exc}") from exc
    finally:
        _tls.data = None
