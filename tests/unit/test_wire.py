"""The wire format: exact round-trips of tensors and arrays; anything else refused, never unpickled."""

from __future__ import annotations

import pickle
import struct

import msgspec
import numpy as np
import pytest
import torch

from omni_pipeline import wire
from omni_pipeline.control import AbortMsg, Heartbeat, StageInbound


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(5, 7).to(torch.bfloat16),
        torch.randn(4, 6).t(),  # non-contiguous
        torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)[:, ::2],
        torch.tensor(3.25),  # 0-d
        torch.empty(0, 16),  # empty
        torch.tensor([True, False, True]),
        torch.randn(3).half(),
        torch.randint(0, 255, (9,), dtype=torch.uint8),
    ],
    ids=["bf16", "transposed", "strided", "0d", "empty", "bool", "fp16", "uint8"],
)
def test_tensor_round_trip(t: torch.Tensor) -> None:
    out = wire.decode(wire.encode({"x": t}))["x"]
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_ndarray_and_plain_values() -> None:
    obj = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "s": "hi", "n": [1, 2.5, None], "b": b"\x00"}
    out = wire.decode(wire.encode(obj))
    np.testing.assert_array_equal(out["a"], obj["a"])
    assert out["a"].dtype == np.int16
    assert (out["s"], out["n"], out["b"]) == ("hi", [1, 2.5, None], b"\x00")


def test_tensors_are_views_on_the_frame() -> None:
    buf = bytearray(wire.encode({"x": torch.zeros(1024)}))
    x = wire.decode(memoryview(buf))["x"]
    buf[-4096:] = b"\x01" * 4096  # the tensor's bytes are the frame's last bytes
    assert x[-1].item() != 0.0


def test_buffers_are_aligned() -> None:
    frame = wire.encode({"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5)})
    out = wire.decode(frame)
    assert out["b"].data_ptr() % wire.ALIGN == out["a"].data_ptr() % wire.ALIGN


def test_typed_messages() -> None:
    msg = AbortMsg("r1", "client gone")
    assert wire.decode(wire.encode(msg), AbortMsg) == msg
    with pytest.raises(wire.WireError, match="invalid message"):
        wire.decode(wire.encode(msg), Heartbeat)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode({"t": "nope"}), StageInbound)


def _frame(header: bytes, data: bytes = b"") -> bytes:
    pre = wire.MAGIC + struct.pack("<IQQ", 0, len(header), len(data))
    pad = (-(len(pre) + len(header))) % wire.ALIGN
    return pre + header + b"\x00" * pad + data


def test_unknown_extension_refused() -> None:
    with pytest.raises(wire.WireError, match="unknown extension type 7"):
        wire.decode(_frame(msgspec.msgpack.encode(msgspec.msgpack.Ext(7, b"x"))))


def test_pickle_refused() -> None:
    with pytest.raises(wire.WireError, match="bad magic"):
        wire.decode(pickle.dumps({"x": torch.zeros(3)}))


def test_tensor_outside_frame_refused() -> None:
    head = struct.pack("<BBQQ", 0, 1, 0, 4000) + struct.pack("<q", 1000)
    with pytest.raises(wire.WireError, match="outside its frame"):
        wire.decode(_frame(msgspec.msgpack.encode(msgspec.msgpack.Ext(wire.EXT_TENSOR, head)), b"\x00" * 64))


def test_truncated_and_garbage_refused() -> None:
    good = wire.encode({"x": torch.ones(100)})
    with pytest.raises(wire.WireError):
        wire.decode(good[:-10])
    with pytest.raises(wire.WireError):
        wire.decode(b"OMW1garbage")


def test_unencodable_refused() -> None:
    with pytest.raises(wire.WireError):
        wire.encode({"x": np.array([object()])})
    with pytest.raises(wire.WireError):
        wire.encode({"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(wire.WireError):
        wire.encode({"x": object()})


def test_payload_nbytes_counts_what_a_frame_carries_without_encoding_it() -> None:
    """What decides whether a payload rides inline (put on the loop) or goes to a backend (off
    it): its tensors', arrays' and texts' bytes, inside structs, dicts and lists."""
    from omni_pipeline.control import RequestInputs, RequestPayload

    inputs = RequestInputs(["text"], messages=[{"role": "user", "content": "x" * 1000}])
    payload = RequestPayload(inputs, {"m0": torch.zeros(10, 4), "m1": np.zeros(3, dtype=np.int64)})
    assert wire.payload_nbytes(payload) == len("user") + 1000 + len("text") + 160 + 24
    assert wire.payload_nbytes({"hidden": [torch.zeros(2, dtype=torch.bfloat16)], "n": 3}) == 4
    assert wire.payload_nbytes(payload) <= len(wire.encode(payload))
