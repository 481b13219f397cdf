"""The gateway against the orderings of NATS messages that used to fail finished requests.

A request's own messages (outputs, StageDone, errors) reach the gateway on its inbox; heartbeats
on their subject. nats-py runs each subscription's callbacks in a task of its own, so nothing
orders the two: an old instance's last output may be read after its stopping beat and after its
successor's first beat. Here the test plays the thinker replica over a real nats-server, so it
chooses that order exactly; the gateway is the real Pipeline. (A real stage process cannot
be made to send in a chosen interleaving; tests/integration/test_distributed.py runs the real
rolling restart.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg

from omni_gateway.events import Finished, TextDelta
from omni_gateway.pipeline import Pipeline
from omni_gateway.request import Prepared
from omni_pipeline.control import (
    Admitted,
    FinalMsg,
    Heartbeat,
    RequestInputs,
    StageRequest,
    Subjects,
    pack,
    unpack,
)
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind, load_pipeline
from tests.helpers import ROOT, wait_until

PIPELINE = load_pipeline(ROOT / "tests" / "data" / "synthetic.yaml")
SUBJECTS = Subjects(PIPELINE.name)
TEXT = Prepared(RequestInputs(["text"]), Sampling(), frozenset({OutputKind.TEXT}), {})
"""A request for text, past the pre-flight checks."""


def beat(instance: str, draining: bool = False, stopping: bool = False) -> bytes:
    return pack(
        Heartbeat(
            stage="thinker",
            replica="0",
            instance=instance,
            pid=1,
            host="test",
            queued=0,
            inflight=0,
            capacity=4,
            max_queued=4,
            draining=draining,
            stopping=stopping,
            interval_s=60.0,  # no expiry during the test: only the order of messages matters
        )
    )


class PlayedThinker:
    """Thinker replica 0 as the test plays it: admits whatever it is sent and keeps it."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.requests: list[StageRequest] = []

    async def start(self) -> None:
        await self.nc.subscribe(SUBJECTS.stage_inbox("thinker", "0"), cb=self._admit)

    async def _admit(self, msg: Msg) -> None:
        self.requests.append(unpack(msg.data, StageRequest))
        await msg.respond(pack(Admitted(True)))

    async def finish(self, req: StageRequest, text: str) -> None:
        final = FinalMsg(req.ctx.request_id, "thinker", "0", "text", 0, True, text, finish_reason="stop")
        await self.nc.publish(req.ctx.reply_to, pack(final))

    async def beat(self, instance: str, **state: bool) -> None:
        await self.nc.publish(SUBJECTS.heartbeat, beat(instance, **state))
        await self.nc.flush()


@pytest.fixture
async def gateway(nats_url: str) -> AsyncIterator[tuple[Pipeline, PlayedThinker]]:
    client = Pipeline(PIPELINE, nats_url)
    assert await client.start()
    nc = await nats.connect(nats_url)
    thinker = PlayedThinker(nc)
    await thinker.start()
    try:
        yield client, thinker
    finally:
        await client.stop()
        await nc.close()


def instances(client: Pipeline) -> list[str]:
    return [r["instance"] for r in client.replicas()]


async def test_output_read_after_the_stop_and_the_successor_still_completes(
    gateway: tuple[Pipeline, PlayedThinker],
) -> None:
    client, thinker = gateway
    await thinker.beat("old")
    await wait_until(lambda: instances(client) == ["old"], 10, "the old instance registered")
    events = client.run("r1", TEXT)
    first = asyncio.ensure_future(anext(events))
    req = await wait_until(lambda: thinker.requests and thinker.requests[0], 10, "r1 admitted")

    # The old instance drains, stops, and a new one starts under the same name; the gateway
    # reads all of that before the old instance's last output of r1.
    await thinker.beat("old", draining=True)
    await thinker.beat("old", stopping=True)
    await thinker.beat("new")
    await wait_until(lambda: instances(client) == ["new"], 10, "the successor alone in the table")
    await thinker.beat("old", draining=True)  # a beat sent before the stop, read after it
    assert not first.done()  # r1 was not failed for what it did not depend on
    await thinker.finish(req, "hello")

    assert await first == TextDelta("hello")
    assert isinstance(await anext(events), Finished)
    assert instances(client) == ["new"]
    assert client.announced.table.pick("thinker").hb.instance == "new"


async def test_a_successor_without_a_drain_means_the_old_instance_died(
    gateway: tuple[Pipeline, PlayedThinker],
) -> None:
    """A new instance while the old one was serving (not draining): the old one was killed and
    restarted, so what it held is lost; the request goes again, to the new instance."""
    client, thinker = gateway
    await thinker.beat("old")
    await wait_until(lambda: instances(client) == ["old"], 10, "the old instance registered")
    events = client.run("r2", TEXT)
    first = asyncio.ensure_future(anext(events))
    await wait_until(lambda: len(thinker.requests) == 1, 10, "r2 admitted")

    await thinker.beat("new")
    retry = await wait_until(lambda: len(thinker.requests) == 2 and thinker.requests[1], 10, "r2 sent again")
    assert retry.ctx.request_id == "r2-1"
    await thinker.finish(retry, "again")
    assert await first == TextDelta("again")
    assert isinstance(await anext(events), Finished)
