"""Backpressure between stages: a slow consumer slows its producer; nothing is dropped.

A producer 20x faster than its consumer over a window-1 edge (tests/data/
synthetic-backpressure.yaml, credit 8) serves a 2000-token request in full while at most 8
of its chunks wait in shared memory, read from the real segments in /dev/shm and from the
producer's own gauge. Then two requests admitted by the two stages in opposite orders (what
concurrent gateways can do): the producer pauses the one its consumer has queued and runs the
other, so neither waits for the other until its deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import nats
import openai
import pytest
import yaml

from omni_cli.natsd import EmbeddedNats
from omni_pipeline.control import (
    Admitted,
    ErrorMsg,
    FinalMsg,
    GatewayInbound,
    RequestContext,
    RequestInputs,
    StageRequest,
    Subjects,
    pack,
    unpack,
)
from omni_pipeline.sampling import Sampling
from tests.deployment import Deployment, deployed, metric_values
from tests.helpers import ROOT, replicas, shm_prefix, shm_segments_in_use, wait_for

PIPELINE = ROOT / "tests" / "data" / "synthetic-backpressure.yaml"
PREFIX = shm_prefix("backpressure")
CREDIT = 8
TOKENS = 2000
HIDDEN_BYTES = 1024 * 4  # the producer's hidden states per unit (float32)
LONG = 60
"""The held request's tokens when the consumer is slowed to 50 ms a token: 3 s."""
USER: Final = {"role": "user", "content": "a long answer"}


@pytest.fixture
def pipeline(nats: EmbeddedNats, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """The pipeline; with a parameter (maxUnreadBytes, msPerUnit), the producer's maxUnreadBytes
    and the consumer's speed set to it."""
    env = {"OMNI_SHM_PREFIX": PREFIX}
    path = PIPELINE
    if (param := getattr(request, "param", None)) is not None:
        doc = yaml.safe_load(PIPELINE.read_text())
        (
            doc["spec"]["stages"][0]["maxUnreadBytes"],
            doc["spec"]["stages"][1]["engine"]["args"]["msPerUnit"],
        ) = param
        path = tmp_path / PIPELINE.name
        path.write_text(yaml.safe_dump(doc))
    with deployed(path, {"producer": 1, "consumer": 1}, 1, nats.url, ROOT, tmp_path, env) as d:
        # Warm: the gateway's first request makes what it keeps for good (its reply subscription).
        _client(d).chat.completions.create(model="backpressure", messages=[USER], max_tokens=4)
        yield d
    assert shm_segments_in_use(PREFIX) == []


def _client(d: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.base}/v1", api_key="unused", max_retries=0, timeout=120)


class _Peaks(threading.Thread):
    """Polls the producer's unread bytes and our segments in use until stopped; keeps the peaks."""

    def __init__(self, metrics_url: str) -> None:
        super().__init__(daemon=True)
        self.url = metrics_url
        self.unread_bytes = 0.0
        self.segments = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            unread = metric_values(self.url, ("omni_stage_unread_bytes",))["omni_stage_unread_bytes"]
            self.unread_bytes = max(self.unread_bytes, unread)
            self.segments = max(self.segments, len(shm_segments_in_use(PREFIX)))
            self.samples += 1


def test_slow_consumer_slows_its_producer(pipeline: Deployment) -> None:
    producer = replicas(pipeline.base, "producer")[0]
    metrics_url = f"http://127.0.0.1:{producer['metrics_port']}/metrics"
    idle = pipeline.gauges()
    client = _client(pipeline)

    peaks = _Peaks(metrics_url)
    peaks.start()
    t0 = time.monotonic()
    try:
        r = client.chat.completions.create(model="backpressure", messages=[USER])
    finally:
        peaks.done.set()
        peaks.join()
    wall = time.monotonic() - t0

    words = (r.choices[0].message.content or "").split()
    assert words == [f"tok{i}" for i in range(TOKENS)]  # all of it, in order
    assert r.usage is not None and r.usage.completion_tokens == TOKENS
    blocked = metric_values(metrics_url, ("omni_stage_credit_wait_seconds_total",))
    waited = blocked["omni_stage_credit_wait_seconds_total"]
    print(
        f"backpressure: {TOKENS} chunks in {wall:.1f}s; producer paused {waited:.1f}s; peak unread "
        f"{peaks.unread_bytes:.0f} bytes, peak segments in use {peaks.segments} ({peaks.samples} samples)"
    )
    assert waited > 0  # the producer was held back
    assert 0 < peaks.unread_bytes <= CREDIT * (HIDDEN_BYTES + 1024)  # a chunk: its states and ids
    # The unread chunks; the one the consumer's engine is on (read zero-copy, its segment held
    # until the call ends); the request's own inputs, which the producer's engine holds.
    assert peaks.segments <= CREDIT + 2
    pipeline.settle(idle)


async def _opposite_orders(nats_url: str) -> dict[str, str]:
    """Reserve B then A at the consumer (A queued behind B), start A then B at the producer
    (B queued behind A): as a gateway would, but in the order two racing gateways can."""
    subjects = Subjects("backpressure")
    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    ended: dict[str, str] = {}
    both = asyncio.Event()

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        m = unpack(msg.data, GatewayInbound)
        if isinstance(m, ErrorMsg):
            ended[m.request_id] = f"error: {m.message}"
        elif isinstance(m, FinalMsg) and m.is_last:
            ended[m.request_id] = "ok"
        if len(ended) == 2:
            both.set()

    await nc.subscribe(inbox, cb=on_reply)
    route = {"producer": "a", "consumer": "a"}
    ctx = {rid: RequestContext(rid, route, inbox, time.time() + 60) for rid in ("req-a", "req-b")}
    prompt = RequestInputs(messages=[{"role": "user", "content": "hi"}])
    try:
        order = [("req-b", "consumer"), ("req-a", "consumer"), ("req-a", "producer"), ("req-b", "producer")]
        for rid, stage in order:
            inputs = prompt if stage == "producer" else None
            request = StageRequest(ctx[rid], inputs, Sampling(max_tokens=10 * CREDIT))
            reply = await nc.request(subjects.stage_inbox(stage, "a"), pack(request), timeout=5)
            assert unpack(reply.data, Admitted).ok, (rid, stage)
        await asyncio.wait_for(both.wait(), 60)
    finally:
        await nc.close()
    return ended


def test_requests_admitted_in_opposite_orders_do_not_wait_on_each_other(pipeline: Deployment) -> None:
    idle = pipeline.gauges()
    assert asyncio.run(_opposite_orders(pipeline.nats_url)) == {"req-a": "ok", "req-b": "ok"}
    pipeline.settle(idle)


@pytest.mark.parametrize("pipeline", [(HIDDEN_BYTES, 50)], indirect=True)
def test_a_replica_whose_consumers_fall_behind_admits_nothing_new(pipeline: Deployment) -> None:
    """Past maxUnreadBytes of output unread, the producer refuses new requests (429 naming the
    limit) and serves the one it holds to the end.

    The mark is one chunk and the consumer takes 50 ms a chunk: with the edge's credit of 8
    chunks, the producer's unread output falls under the mark only if the producer stalls for
    the 350 ms the consumer takes to read 7 chunks. (At 2 ms a chunk and a mark of 4, a stall of
    8 ms on a loaded machine was enough, and the new request was queued instead of refused.)"""
    producer = replicas(pipeline.base, "producer")[0]
    metrics_url = f"http://127.0.0.1:{producer['metrics_port']}/metrics"
    client = _client(pipeline)
    long: dict[str, object] = {}

    def long_request() -> None:
        long["answer"] = client.chat.completions.create(
            model="backpressure", messages=[USER], max_tokens=LONG
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        wait_for(
            lambda: (
                metric_values(metrics_url, ("omni_stage_unread_bytes",))["omni_stage_unread_bytes"]
                >= HIDDEN_BYTES
            ),
            30,
            "the producer's unread output to pass its mark",
        )
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="backpressure", messages=[USER], max_tokens=4)
        assert "bytes of its output wait unread by its consumers (maxUnreadBytes 4096)" in str(refused.value)
    finally:
        thread.join(120)
    answer = long["answer"]
    assert isinstance(answer, openai.types.chat.ChatCompletion)
    assert answer.usage is not None and answer.usage.completion_tokens == LONG
