"""Warm buffers: reused, given back when the last view goes, and bounded while idle."""

from __future__ import annotations

import gc

import torch

from omni_pipeline import wire
from omni_pipeline.connectors.buffers import BufferPool, capacities_for, capacity_class


def test_capacity_classes_waste_at_most_an_eighth() -> None:
    for size in (1, 70_000, 1 << 20, (64 << 20) + 100, 256 << 20):
        cap = capacity_class(size)
        assert cap >= size and (cap <= size * 1.125 or cap == 64 << 10)
        assert cap in capacities_for(size) and size in capacities_for(size)
        assert size - 1 not in capacities_for(size)
    assert 64 << 20 not in capacities_for(100_000), "a small payload must not pin a large buffer"


def test_a_buffer_given_back_is_taken_again() -> None:
    pool = BufferPool(idle_bytes=1 << 30)
    a = pool.take(1 << 20)
    pool.give(a)
    assert pool.take((1 << 20) - 100) is a
    assert pool.take(1 << 20) is not a  # taken: the caller's until given back


def test_a_lease_comes_back_when_its_last_tensor_is_freed() -> None:
    pool = BufferPool(idle_bytes=1 << 30)
    frame = wire.encode_frame({"x": torch.arange(100_000, dtype=torch.float32)})
    view = pool.lease(frame.size)
    frame.write_into(memoryview(view))
    x = wire.decode(memoryview(view))["x"]
    del view
    gc.collect()
    assert pool.idle() == 0, "the tensor still uses it"
    assert x[-1].item() == 99_999.0
    del x
    assert pool.idle() == capacity_class(frame.size)


def test_idle_memory_is_bounded() -> None:
    pool = BufferPool(idle_bytes=3 << 20)
    bufs = [pool.take(1 << 20) for _ in range(5)]
    for b in bufs:
        pool.give(b)
    assert pool.idle() == 3 << 20
    kept = {id(pool.take(1 << 20)) for _ in range(3)}
    assert kept == {id(b) for b in bufs[2:]}, "the least recently given back went first"
