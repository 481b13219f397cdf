"""What the pipeline's control subject asks of every replica: sleep and wake (for the stages a
message names; omni_stage.sleep does it, answering the gateway), and forget a conversation's
kept prompt (its prompt cache and audio heard ahead)."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from omni_pipeline import wire
from omni_pipeline.control import ControlInbound, ForgetPromptMsg, SleepMsg, Subjects, unpack
from omni_stage.engines.base import Engine
from omni_stage.sleep import SleepControl

log = logging.getLogger("omni.stage")


async def serve_commands(
    nc: NATS, subjects: Subjects, stage: str, engine: Engine, sleep: SleepControl
) -> None:
    """Answer the control subject, which every replica of every stage hears."""

    async def on_message(msg: Msg) -> None:
        try:
            m: ControlInbound = unpack(msg.data, ControlInbound)
        except wire.WireError as exc:
            log.warning("stage %s: refused a control message: %s", stage, exc)
            return
        if isinstance(m, ForgetPromptMsg):
            for held in (engine.prompt_caches, engine.audio_ahead):
                if held is not None:
                    held.forget(m.key)
        elif stage in m.stages:
            sleep.spawn(sleep.sleep(m.level, m.mode) if isinstance(m, SleepMsg) else sleep.wake(), msg.reply)

    await nc.subscribe(subjects.control, cb=on_message)
