"""/tokenize and /detokenize: asked of the first source stage's replicas (one answers), with the
tokenizer and chat template its engine reads a client's prompt with."""

from __future__ import annotations

from typing import Final

import nats.errors

from omni_gateway.bus import Bus
from omni_gateway.errors import BadRequest, NotServed, StageFailed, Unavailable
from omni_gateway.preflight import Announced
from omni_pipeline.control import DetokenizeMsg, ErrorCode, TokenizeMsg, TokenizeReply, pack, unpack
from omni_pipeline.wire import WireError

TOKENIZE_TIMEOUT_S: Final = 10.0
"""How long /tokenize waits for a stage (a long prompt through a chat template)."""


async def tokenize(bus: Bus, announced: Announced, msg: TokenizeMsg | DetokenizeMsg) -> TokenizeReply:
    """The first source stage's answer; NotServed where no source stage reads text."""
    spec = announced.spec
    stage = next(
        (s.name for s in spec.stages if s.name in announced.reading and not s.skip_without_media), None
    )
    if stage is None or bus.table.tokenizes(stage) is False:
        raise NotServed(
            f"model '{spec.served_model_name}' has no tokenizer to count with "
            f"(no source stage's engine reads text)"
        )
    if bus.nc is None:
        raise Unavailable("the gateway is not connected to NATS")
    try:  # a template's variables go as they came: a number past 64 bits, a lone surrogate
        data = bus.sized(pack(msg))
    except WireError as exc:
        raise BadRequest(f"the request cannot be sent on to stage '{stage}': {exc}") from None
    try:
        reply = await bus.nc.request(bus.subjects.tokenize(stage), data, timeout=TOKENIZE_TIMEOUT_S)
    except nats.errors.NoRespondersError:
        raise Unavailable(
            f"stage '{stage}' has no replica that tokenizes (none live, or its engine reads no text)"
        ) from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise Unavailable(f"stage '{stage}' did not answer in {TOKENIZE_TIMEOUT_S:g}s") from None
    answer: TokenizeReply = unpack(reply.data, TokenizeReply)
    if not answer.ok:
        if answer.code == ErrorCode.INVALID_REQUEST:
            raise BadRequest(f"stage '{stage}': {answer.message}")
        raise StageFailed(f"stage '{stage}': {answer.message}")
    return answer
