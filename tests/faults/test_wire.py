"""Hostile bytes on the control plane and in shared memory, sent to real stage processes.

A stage replica must refuse what is not one of our frames (a pickle, an unknown msgpack
extension, a segment full of garbage), say so in its log, fail at most the request the bytes
claimed to belong to, and go on serving. Nothing is ever unpickled: the pickle below would
leave a file behind if it were.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest

from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorHandle
from omni_pipeline.control import (
    Admitted,
    ErrorMsg,
    FinalMsg,
    GatewayInbound,
    RequestContext,
    RequestInputs,
    SegmentMsg,
    StageDone,
    StageRequest,
    Subjects,
    pack,
    unpack,
)
from omni_pipeline.sampling import Sampling
from tests.helpers import ROOT, OmniProcess, shm_prefix, start_stage, wait_for

PIPELINE = ROOT / "tests" / "data" / "synthetic.yaml"
PREFIX = shm_prefix("wire")
INBOX = "omni.synth.gateway.wiretest"


class _Bomb:
    """Unpickling this creates `path`: proof that someone unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


@dataclass
class Stages:
    thinker: OmniProcess
    talker: OmniProcess
    nats_url: str


@pytest.fixture
def stages(nats_url: str, tmp_path: Path) -> Iterator[Stages]:
    env = {"OMNI_SHM_PREFIX": PREFIX}
    procs = [start_stage(PIPELINE, s, "0", nats_url, ROOT, tmp_path, env) for s in ("thinker", "talker")]
    try:
        yield Stages(procs[0], procs[1], nats_url)
    finally:
        for p in procs:
            assert p.stop() == 0, p.output()[-2000:]


def _ctx(rid: str, route: dict[str, str]) -> RequestContext:
    return RequestContext(rid, route, INBOX, time.time() + 30)


def _unknown_extension_frame() -> bytes:
    """A well-formed StageRequest whose sampling holds, where a value may be anything (a chat
    template's variables), a msgpack extension value we never define."""
    ctx = msgspec.to_builtins(_ctx("unknown-ext", {"thinker": "0"}))
    sampling = {"chat_template_kwargs": {"x": msgspec.msgpack.Ext(99, b"\x00" * 18)}}
    header = msgspec.msgpack.encode({"type": "request", "ctx": ctx, "inputs": None, "sampling": sampling})
    frame = wire.MAGIC + bytes(4) + len(header).to_bytes(8, "little") + bytes(8) + header
    return frame.ljust(-(-len(frame) // wire.ALIGN) * wire.ALIGN, b"\x00")


async def _exchange(nats_url: str, steps: object) -> list[object]:
    """Connect as a gateway would, run `steps(nc, replies)`, return the replies collected."""
    nc = await nats.connect(nats_url)
    replies: asyncio.Queue[object] = asyncio.Queue(100)

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        replies.put_nowait(unpack(msg.data, GatewayInbound))

    await nc.subscribe(INBOX, cb=on_reply)
    try:
        return await steps(nc, replies)  # type: ignore[operator, no-any-return]
    finally:
        await nc.close()


async def _until_last(replies: asyncio.Queue[object]) -> list[object]:
    got: list[object] = []
    async with asyncio.timeout(30):
        while True:
            m = await replies.get()
            got.append(m)
            if isinstance(m, ErrorMsg) or (isinstance(m, FinalMsg) and m.is_last) or isinstance(m, StageDone):
                return got


def test_a_pickle_or_unknown_extension_on_nats_is_refused(stages: Stages, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    inbox = Subjects("synth").stage_inbox("thinker", "0")

    async def steps(nc: nats.NATS, replies: asyncio.Queue[object]) -> list[object]:
        await nc.publish(inbox, pickle.dumps(_Bomb(marker)))
        await nc.publish(inbox, _unknown_extension_frame())
        await nc.publish(inbox, b"\x00" * 64)
        await nc.flush()
        # The replica still serves: a real request after the garbage is answered in full.
        ctx = _ctx("after-garbage", {"thinker": "0"})
        req = StageRequest(
            ctx, RequestInputs(messages=[{"role": "user", "content": "hi"}]), Sampling(max_tokens=3)
        )
        admitted: Admitted = unpack((await nc.request(inbox, pack(req), timeout=10)).data, Admitted)
        assert admitted.ok, admitted
        return await _until_last(replies)

    got = asyncio.run(_exchange(stages.nats_url, steps))
    assert isinstance(got[-1], FinalMsg) and got[-1].is_last
    assert "".join(m.text for m in got if isinstance(m, FinalMsg)) == "tok0 tok1 tok2 "
    assert not marker.exists(), "a pickle from the network was unpickled"
    log = stages.thinker.output()
    assert log.count("refused a message") == 3
    assert "bad magic" in log and "unknown extension type 99" in log


def test_garbage_in_a_segment_fails_only_its_request(stages: Stages, tmp_path: Path) -> None:
    """A segment handle pointing at a crafted /dev/shm file, and an inline handle holding a pickle."""
    marker = tmp_path / "unpickled"
    inbox = Subjects("synth").stage_inbox("talker", "0")
    route = {"thinker": "0", "talker": "0"}
    crafted = Path("/dev/shm") / f"{PREFIX}-in-shm~thinker-talker-0@{os.getpid()}-990001"
    crafted.write_bytes(pickle.dumps(_Bomb(marker)).ljust(4096, b"\x00"))
    evil = {
        "in-shm": ConnectorHandle("default", 4096, key=crafted.name),
        "inline": ConnectorHandle("default", 64, inline=pickle.dumps(_Bomb(marker))),
    }

    async def steps(nc: nats.NATS, replies: asyncio.Queue[object]) -> list[object]:
        errors = []
        for rid, handle in evil.items():
            ctx = _ctx(rid, route)
            admitted: Admitted = unpack(
                (await nc.request(inbox, pack(StageRequest(ctx, None, Sampling())), timeout=10)).data,
                Admitted,
            )
            assert admitted.ok, admitted
            await nc.publish(inbox, pack(SegmentMsg(ctx, "thinker", 0, True, 1, handle)))
            errors += await _until_last(replies)
        return errors

    try:
        errors = asyncio.run(_exchange(stages.nats_url, steps))
    finally:
        for leftover in Path("/dev/shm").glob(f"{PREFIX}-*990001*"):
            leftover.unlink()
    assert [type(e) for e in errors] == [ErrorMsg, ErrorMsg]
    assert all(
        isinstance(e, ErrorMsg)
        and e.code == "connector_error"
        and "connector 'default' (shm): get failed: not an omni-pipeline frame" in e.message
        for e in errors
    ), errors
    assert not marker.exists(), "a pickle from shared memory was unpickled"
    assert stages.talker.proc.poll() is None


def test_a_route_that_feeds_a_stage_nothing_is_refused_at_once(stages: Stages) -> None:
    """A consumer whose producers are all off the route would wait for its deadline: refuse it."""
    inbox = Subjects("synth").stage_inbox("talker", "0")

    async def steps(nc: nats.NATS, _: asyncio.Queue[object]) -> list[object]:
        req = StageRequest(_ctx("no-producer", {"talker": "0"}), None, Sampling())
        return [unpack((await nc.request(inbox, pack(req), timeout=10)).data, Admitted)]

    [answer] = asyncio.run(_exchange(stages.nats_url, steps))
    assert isinstance(answer, Admitted) and not answer.ok and answer.code == "bad_route"
    assert "none of its inputs (thinker) is on the route" in answer.message
    wait_for(lambda: stages.talker.proc.poll() is None, 1, "the talker to keep running")
