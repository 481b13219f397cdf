"""A source stage's answers to /tokenize and /detokenize (vLLM's endpoints): its engine's own
tokenizer and chat template, so the ids a client counts are the ids the stage will read.

The gateway asks by request/reply on the stage's tokenize subject, which its replicas share as
a queue group: one answers. Work runs on a thread, off the loop that beats and admits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from omni_pipeline import wire
from omni_pipeline.control import (
    DetokenizeMsg,
    ErrorCode,
    Subjects,
    TokenizeInbound,
    TokenizeMsg,
    TokenizeReply,
    pack,
    unpack,
)
from omni_stage.engines.base import Engine, InvalidRequest
from omni_stage.engines.prompts import chat_template_args, messages_to_chat

log = logging.getLogger("omni.stage")

QUEUE = "tokenize"


async def serve_tokenize(nc: NATS, subjects: Subjects, stage: str, engine: Engine) -> None:
    """Answer on `stage`'s tokenize subject, where the engine reads text."""
    if engine.prompt_tokenizer() is None:
        return

    async def on_message(msg: Msg) -> None:
        try:
            m: TokenizeMsg | DetokenizeMsg = unpack(msg.data, TokenizeInbound)
        except wire.WireError as exc:
            log.warning("stage %s: refused a tokenize message: %s", stage, exc)
            return
        reply = await asyncio.to_thread(answer, engine, m)
        if msg.reply:
            await msg.respond(pack(reply))

    await nc.subscribe(subjects.tokenize(stage), queue=QUEUE, cb=on_message)


def answer(engine: Engine, m: TokenizeMsg | DetokenizeMsg) -> TokenizeReply:
    found = engine.prompt_tokenizer()
    assert found is not None
    tokenizer, context = found
    try:
        if isinstance(m, DetokenizeMsg):
            vocab = len(tokenizer)
            if bad := [t for t in m.tokens if not 0 <= t < vocab]:
                raise InvalidRequest(f"tokens: {bad[0]} is not in the vocabulary (0 to {vocab - 1})")
            return TokenizeReply(True, prompt=tokenizer.decode(m.tokens))
        ids = tokenize(tokenizer, m)
        strs = tokenizer.convert_ids_to_tokens(ids) if m.return_token_strs else []
        return TokenizeReply(True, tokens=ids, token_strs=strs, max_model_len=context)
    except InvalidRequest as exc:
        return TokenizeReply(False, code=ErrorCode.INVALID_REQUEST, message=str(exc))
    except Exception as exc:
        log.exception("stage: tokenize failed")
        return TokenizeReply(False, code=ErrorCode.STAGE_ERROR, message=f"{type(exc).__name__}: {exc}")


def tokenize(tokenizer: Any, m: TokenizeMsg) -> list[int]:
    """As vLLM's /tokenize: a prompt with the tokenizer's special tokens (unless asked not to),
    messages through the chat template without them (unless asked to)."""
    inputs = m.inputs
    if inputs.messages is not None:
        try:
            text = tokenizer.apply_chat_template(
                messages_to_chat(inputs.messages),
                tools=inputs.tools or None,
                tokenize=False,
                **chat_template_args(m.template),
            )
        except ValueError as exc:
            raise InvalidRequest(f"the chat template cannot apply: {exc}") from None
    else:
        text = inputs.prompt or ""
    return list(tokenizer(text, add_special_tokens=m.add_special_tokens)["input_ids"])
