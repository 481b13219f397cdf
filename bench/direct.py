"""This process in a gateway's place on NATS, speaking to stage replicas directly: the baseline
that shows what the gateway (or a stage) adds on top of the control plane itself."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from nats.aio.client import Client as NatsClient

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


class DirectClient:
    """Sends a pipeline's stage messages and awaits each request's last output, by request id."""

    def __init__(self, nc: NatsClient, pipeline: str) -> None:
        self.nc = nc
        self.subjects = Subjects(pipeline)
        self.inbox = self.subjects.gateway_inbox("bench")
        self._done: dict[str, asyncio.Future[None]] = {}
        self._ids = itertools.count()

    async def start(self) -> None:
        async def on_reply(msg: Any) -> None:
            m = unpack(msg.data, GatewayInbound)
            fut = self._done.get(m.request_id)
            if fut is None or fut.done():
                return
            if isinstance(m, ErrorMsg):
                fut.set_exception(RuntimeError(f"{m.stage}: {m.message}"))
            elif isinstance(m, FinalMsg) and m.is_last:
                fut.set_result(None)

        await self.nc.subscribe(self.inbox, cb=on_reply)

    def context(self, route: dict[str, str]) -> RequestContext:
        rid = f"d{next(self._ids)}"
        self._done[rid] = asyncio.get_running_loop().create_future()
        return RequestContext(rid, route, self.inbox, time.time() + 60)

    async def admit(self, stage: str, ctx: RequestContext, inputs: RequestInputs | None) -> None:
        subject = self.subjects.stage_inbox(stage, ctx.route[stage])
        reply = await self.nc.request(subject, pack(StageRequest(ctx, inputs, Sampling())), timeout=30)
        if not (admitted := unpack(reply.data, Admitted)).ok:
            raise RuntimeError(f"{stage} refused: {admitted.message}")

    async def finished(self, ctx: RequestContext) -> None:
        """Until the request's last output arrives (its ErrorMsg raises)."""
        try:
            await asyncio.wait_for(self._done[ctx.request_id], 60)
        finally:
            del self._done[ctx.request_id]
