"""What a replica says on NATS: chunks to its consumers, outputs and errors to a request's gateway,
admission answers, credit, heartbeats.

One place for every publish, so the state machine and the request runner never touch the
client: each message is a typed struct from omni_pipeline.control. Publishing while NATS is
away is the client's to buffer or fail; a failure to send an error or an answer is logged by
nobody and swallowed here (the gateway's own deadline and replica expiry are the backstops).
"""

from __future__ import annotations

import contextlib

import msgspec
from nats.aio.client import Client as NatsClient

from omni_pipeline.control import (
    Admitted,
    CreditMsg,
    ErrorCode,
    ErrorMsg,
    FinalMsg,
    RequestContext,
    SegmentMsg,
    StageDone,
    Subjects,
    pack,
)


class Outbox:
    """One replica's outgoing messages; `nc` is set once NATS is reached."""

    def __init__(self, subjects: Subjects, stage: str, replica: str) -> None:
        self.subjects = subjects
        self.stage = stage
        self.replica = replica
        self.nc: NatsClient | None = None

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def segment(self, consumer: str, msg: SegmentMsg) -> None:
        """A chunk's handle, to the consumer's replica on the request's route."""
        assert self.nc is not None
        await self.nc.publish(self.subjects.stage_inbox(consumer, msg.ctx.route[consumer]), pack(msg))

    async def final(self, ctx: RequestContext, msg: FinalMsg | StageDone) -> None:
        """An output for the client, or (a stage without one) the word that it is done."""
        assert self.nc is not None
        await self.nc.publish(ctx.reply_to, pack(msg))

    async def credit(self, ctx: RequestContext, producer: str) -> None:
        """A chunk read: one chunk of credit back to the producer's replica."""
        assert self.nc is not None
        credit = pack(CreditMsg(ctx.request_id, self.stage))
        await self.nc.publish(self.subjects.stage_inbox(producer, ctx.route[producer]), credit)

    async def fail(self, ctx: RequestContext, message: str, code: ErrorCode) -> None:
        """The request ends here with an error, to its gateway."""
        if self.nc is None:
            return
        err = ErrorMsg(ctx.request_id, self.stage, self.replica, message, code)
        with contextlib.suppress(Exception):
            await self.nc.publish(ctx.reply_to, pack(err))

    async def fail_all(self, held: list[RequestContext], message: str, code: ErrorCode) -> None:
        for ctx in held:
            await self.fail(ctx, message, code)

    async def answer(self, reply: str | None, answer: Admitted) -> None:
        """A StageRequest's admission (or refusal), to the gateway that asked."""
        await self.reply(reply, answer)

    async def reply(self, reply: str | None, msg: msgspec.Struct) -> None:
        if reply and self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(reply, pack(msg))

    async def broadcast(self, subject: str, msg: msgspec.Struct) -> None:
        """A message for every gateway (heartbeats), only while connected: a beat never waits."""
        if self.connected:
            assert self.nc is not None
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, pack(msg))
