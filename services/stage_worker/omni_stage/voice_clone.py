"""A cloning source stage's answers to the gateway's clone requests (POST /v1/audio/voices): the
voice taken from a clip by the stage's own engine, once, for the gateway to keep.

The gateway asks by request/reply on the stage's clone subject, which its replicas share as a
queue group: one answers. The engine works on its compute thread, off the loop that beats and
admits. A replica asleep answers SLEEPING (its weights may be gone); another may answer next time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from omni_pipeline import wire
from omni_pipeline.connectors import ConnectorError, ConnectorHandle
from omni_pipeline.control import ErrorCode, Subjects, pack, unpack
from omni_pipeline.voices import CloneVoiceMsg, CloneVoiceReply
from omni_stage.engines.base import Engine, InvalidRequest
from omni_stage.state import ReplicaState

log = logging.getLogger("omni.stage")

QUEUE = "clone"


async def serve_cloning(
    nc: NATS,
    subjects: Subjects,
    stage: str,
    engine: Engine,
    read: Callable[[str, ConnectorHandle], Awaitable[dict[str, Any]]],
    state: ReplicaState,
) -> None:
    """Answer on `stage`'s clone subject, where the engine clones voices; `read`: a request's
    payload off the stage's request edge (RequestRunner.read_request); `state`: the replica's
    (asleep, it answers SLEEPING)."""
    if "ref_audio" not in engine.accepts:
        return

    async def on_message(msg: Msg) -> None:
        try:
            m = unpack(msg.data, CloneVoiceMsg)
        except wire.WireError as exc:
            log.warning("stage %s: refused a clone message: %s", stage, exc)
            return
        reply = await answer(engine, m, read, state.asleep is not None)
        if msg.reply:
            await msg.respond(pack(reply))

    await nc.subscribe(subjects.clone(stage), queue=QUEUE, cb=on_message)


async def answer(
    engine: Engine,
    m: CloneVoiceMsg,
    read: Callable[[str, ConnectorHandle], Awaitable[dict[str, Any]]],
    asleep: bool,
) -> CloneVoiceReply:
    if asleep:  # the clip stays where it is: the gateway frees it
        return CloneVoiceReply(False, code=ErrorCode.SLEEPING, message="the replica is asleep")
    try:
        request = await read(m.request_id, m.payload)
        clip = request.get("ref_audio") or {}
        samples = (request.get("media") or {}).get(clip.get("media"))
        if samples is None or samples.numel() == 0:
            raise InvalidRequest("the clip holds no samples")
        voice = await engine.clone_voice(samples, int(clip["sample_rate"]), m.ref_text)
        return CloneVoiceReply(True, voice=voice)
    except InvalidRequest as exc:
        return CloneVoiceReply(False, code=ErrorCode.INVALID_REQUEST, message=str(exc))
    except ConnectorError as exc:
        return CloneVoiceReply(False, code=ErrorCode.CONNECTOR_ERROR, message=str(exc))
    except Exception as exc:
        log.exception("stage: cloning a voice failed")
        return CloneVoiceReply(False, code=ErrorCode.STAGE_ERROR, message=f"{type(exc).__name__}: {exc}")
