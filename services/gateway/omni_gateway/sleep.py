"""Sleep and wake of stages, as vLLM-Omni's `POST /v1/omni/sleep` and `/v1/omni/wakeup`.

One message on the pipeline's control subject reaches every replica of the named stages (a
broadcast: whatever this gateway knows of them); each answers once it is asleep or awake. The
answer to the client comes when every replica this gateway knew of has answered and its own
replica table routes accordingly, so the request that follows is answered as it should be
(503 for what needs a sleeping stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Final

from nats.aio.msg import Msg

from omni_gateway.bus import RETRY_AFTER, Bus
from omni_gateway.errors import BadRequest, StageFailed, Timeout, Unavailable, Unsupported
from omni_pipeline import wire
from omni_pipeline.control import SleepAck, SleepMsg, WakeMsg, pack, unpack
from omni_pipeline.spec import PipelineSpec

log = logging.getLogger("omni.gateway")

ACKS_PER_REPLICA: Final = 4
"""Room for acks per replica asked (replicas that started since answer too; more are dropped)."""


def stage_names(spec: PipelineSpec, ids: list[int | str]) -> list[str]:
    """vLLM-Omni's stage ids (a stage's index in the pipeline file) or stage names, as names."""
    names = [s.name for s in spec.stages]
    out: list[str] = []
    for sid in ids:
        if isinstance(sid, int) and 0 <= sid < len(names):
            out.append(names[sid])
        elif isinstance(sid, str) and sid in names:
            out.append(sid)
        else:
            listed = ", ".join(f"{i} ({n})" for i, n in enumerate(names))
            raise BadRequest(f"stage_ids: no stage {sid!r}; the stages are {listed}", param="stage_ids")
    return list(dict.fromkeys(out))


async def sleep(bus: Bus, stages: list[str], level: int, mode: str) -> dict[str, Any]:
    for r in bus.table.up(stages):
        deepest = r.hb.max_sleep_level
        if deepest is None or deepest < level:
            can = "cannot sleep" if deepest is None else f"can sleep at most at level {deepest}"
            raise Unsupported(f"stage '{r.hb.stage}' replica {r.hb.replica} {can}", param="level")
    return await _broadcast(bus, SleepMsg(stages, level, mode), stages)


async def wake(bus: Bus, stages: list[str]) -> dict[str, Any]:
    if not any(r.asleep for r in bus.table.up(stages)):
        return {"status": "SKIPPED", "reason": "Target stages are not sleeping."}  # vLLM-Omni's words
    return await _broadcast(bus, WakeMsg(stages), stages)


async def _broadcast(bus: Bus, msg: SleepMsg | WakeMsg, stages: list[str]) -> dict[str, Any]:
    """Send `msg` to every replica of `stages`; their acks, or the error that says who failed."""
    if bus.nc is None or not bus.connected:
        raise Unavailable("the gateway is not connected to NATS", headers=RETRY_AFTER)
    if absent := [s for s in stages if not bus.table.up([s])]:
        raise Unavailable(f"stage '{absent[0]}' has no live replica", headers=RETRY_AFTER)
    asked = {r.hb.instance: r.hb for r in bus.table.up(stages)}
    timeout_s = bus.spec.gateway.request_timeout_s  # a `wait` sleep lets the requests held finish
    acks: asyncio.Queue[SleepAck] = asyncio.Queue(ACKS_PER_REPLICA * len(asked))

    async def on_ack(m: Msg) -> None:
        try:
            ack: SleepAck = unpack(m.data, SleepAck)
        except wire.WireError as exc:
            log.warning("gateway: refused a sleep or wake answer: %s", exc)
            return
        with contextlib.suppress(asyncio.QueueFull):
            acks.put_nowait(ack)

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_ack)
    got: dict[str, SleepAck] = {}
    try:
        await bus.nc.publish(bus.subjects.control, pack(msg), reply=inbox)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not asked.keys() <= got.keys():
                    ack = await acks.get()
                    got[ack.instance] = ack
    finally:
        await sub.unsubscribe()
    what = "sleep" if isinstance(msg, SleepMsg) else "wake"
    if failed := [a for a in got.values() if not a.ok]:
        why = "; ".join(f"stage '{a.stage}' replica {a.replica}: {a.message}" for a in failed)
        raise StageFailed(f"{what} failed: {why}", code=f"{what}_failed")
    if missing := [hb for instance, hb in asked.items() if instance not in got]:
        who = ", ".join(f"stage '{hb.stage}' replica {hb.replica}" for hb in missing)
        raise Timeout(f"{what}: no answer from {who} in {timeout_s:.0f}s")

    def routed() -> bool:  # each replica's own beat (sent before its ack) has reached our table
        return all(
            (r := bus.table.get(a.stage, a.instance)) is None or r.hb.asleep == a.asleep for a in got.values()
        )

    await bus.until_table(routed, timeout_s)
    log.info("gateway: %s of %s: %d replicas answered", what, ", ".join(stages), len(got))
    task = uuid.uuid4().hex
    return {"status": "SUCCESS", "acks": [_ack_body(bus.spec, task, a) for a in _ordered(bus.spec, got)]}


def _ordered(spec: PipelineSpec, acks: dict[str, SleepAck]) -> list[SleepAck]:
    index = {s.name: i for i, s in enumerate(spec.stages)}
    return sorted(acks.values(), key=lambda a: (index.get(a.stage, -1), a.replica))


def _ack_body(spec: PipelineSpec, task: str, a: SleepAck) -> dict[str, Any]:
    """vLLM-Omni's OmniACK fields (task_id, status, stage_id, freed_bytes, metadata), and ours."""
    stage_id = next((i for i, s in enumerate(spec.stages) if s.name == a.stage), None)
    return {
        "task_id": task,
        "status": "SUCCESS",
        "stage_id": stage_id,
        "stage": a.stage,
        "replica": a.replica,
        "level": a.asleep,
        "freed_bytes": a.freed_bytes,
        "metadata": {
            "seconds": round(a.seconds, 6),
            "rss_bytes_before": a.rss_bytes_before,
            "rss_bytes_after": a.rss_bytes_after,
        },
    }
