"""A replica's signs of life: heartbeats, health checks, readiness and the gauges /metrics reads.

Heartbeats go out every interval and whenever the replica's state changes (a sleep, a drain),
and never wait: nothing in a beat asks a backend anything. Health checks run beside them, never
in their way: the engine's own word (dead, or wedged past stepTimeoutSeconds) and each used
connector's (asked off the loop, since a backend that is down may take its timeout to say so).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omni_pipeline import wire
from omni_pipeline.connectors import OmniConnector, reclaim_unread
from omni_pipeline.control import HEARTBEAT_INTERVAL_S, Heartbeat, Subjects
from omni_pipeline.resource_metrics import COUNT_WAIT_S
from omni_pipeline.spec import PipelineSpec
from omni_stage.engines.base import Engine
from omni_stage.metrics import StageMetrics
from omni_stage.outbox import Outbox
from omni_stage.requests import RequestBook
from omni_stage.transfer import Transfers

log = logging.getLogger("omni.stage")


@dataclass(kw_only=True, eq=False)
class Beats:
    """One replica's heartbeats, health and readiness."""

    book: RequestBook
    engine: Engine
    outbox: Outbox
    transfers: Transfers
    metrics: StageMetrics
    subjects: Subjects
    instance: str
    used: set[OmniConnector]
    """The connectors this stage reads or writes through (every process builds them all)."""
    pipeline: PipelineSpec
    metrics_port: int = 0
    """Where its /metrics listens, once bound (the heartbeat tells it)."""

    @property
    def name(self) -> str:
        return f"{self.book.spec.name}/{self.outbox.replica}"

    def readiness(self) -> tuple[bool, str, str]:
        """Ready or not, the status word and why (ReplicaState.readiness)."""
        return self.book.state.readiness(self.outbox.connected)

    async def beat(self, stopping: bool = False) -> None:
        # No gauge refresh here (/metrics does its own): counting a connector's objects may wait
        # on its backend (Mooncake's master, when it is gone), and a beat must never wait.
        load, state = self.book.core.load(), self.book.state
        hb = Heartbeat(
            stage=self.book.spec.name,
            replica=self.outbox.replica,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            queued=load.queued,
            inflight=load.inflight,
            capacity=load.capacity,
            max_queued=load.max_queued,
            draining=state.draining,
            interval_s=HEARTBEAT_INTERVAL_S,
            unhealthy=state.unhealthy,
            metrics_port=self.metrics_port,
            stopping=stopping,
            by_gateway=dict(collections.Counter(st.ctx.reply_to for st in self.book.requests.values())),
            accepts=sorted(self.engine.accepts),
            honours=sorted(self.engine.honours),
            voices=list(self.engine.voices),
            languages=list(self.engine.languages),
            tokenizes=self.book.is_source and self.engine.prompt_tokenizer() is not None,
            asleep=state.asleep,
            max_sleep_level=self.engine.max_sleep_level,
            audio_ahead=self.book.is_source and self.engine.audio_ahead is not None,
            clip_limits=self.engine.clip_limits,
        )
        await self.outbox.broadcast(self.subjects.heartbeat, hb)

    async def beating(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)  # the heartbeat period itself
            await self.beat()

    async def checking(self, also: Callable[[], Awaitable[None]], engine_died: Callable[[str], None]) -> None:
        """Every interval: expire what no consumer will read and the conversations' caches no one
        used for their idle time, reclaim what dead readers held, check the engine and the
        connectors, then `also` (the pipeline file's `paused`)."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            for rid in self.book.ledger.expire(time.time(), keep=self.book.requests):
                log.info("stage %s: request %s: its unread output expired", self.book.spec.name, rid)
            for held in (self.engine.prompt_caches, self.engine.audio_ahead):
                if held is not None:
                    held.expire()
            # Beside the I/O thread, as health checks are: neither waits behind a hung transfer.
            await asyncio.to_thread(reclaim_unread, list(self.used), self.pipeline)
            await self.transfers.call(
                self.metrics.resources.count_connectors, self.transfers.connectors.values()
            )
            if (why := self._engine_failure()) is not None:
                log.error("stage %s: engine dead: %s; failing what it holds", self.name, why)
                engine_died(why)
                return
            await self._check_connectors()
            await also()

    def _engine_failure(self) -> str | None:
        why = self.engine.dead()
        busy, limit = self.engine.busy_s(), self.book.spec.step_timeout_s
        if why is None and busy is not None and limit is not None and busy > limit:
            why = f"wedged: a forward (or a prompt's build) has run for {busy:.0f}s, over "
            why += f"stepTimeoutSeconds ({limit:g}s)"
        return why

    async def _check_connectors(self) -> None:
        """A connector whose backend is down makes the replica take nothing new until it answers."""
        health = await asyncio.to_thread(lambda: [(c, c.health()) for c in self.used])
        unhealthy = "; ".join(
            f"connector '{c.name}' ({c.kind}): {h.get('status') or h.get('error') or 'unhealthy'}"
            for c, h in sorted(health, key=lambda ch: ch[0].name)
            if not h.get("ok", False)
        )
        if unhealthy != self.book.state.unhealthy:
            log.warning("stage %s: %s", self.name, unhealthy or "connectors healthy again")
        self.book.state.unhealthy = unhealthy

    async def refresh_gauges(self) -> None:
        """Before a /metrics scrape (the connectors' counts off the loop, or the last ones)."""
        load = self.book.core.load()
        m = self.metrics
        m.queued.set(load.queued)
        m.inflight.set(load.inflight)
        m.paused.set(load.paused)
        m.tracked.set(len(self.book.requests))
        m.unread_bytes.set(self.book.ledger.unread_bytes)
        m.credit_accounts.set(self.book.ledger.tracked())
        m.resources.refresh(self.outbox.nc)
        every = list(self.transfers.connectors.values())
        await self.transfers.within(COUNT_WAIT_S, m.resources.count_connectors, every)
        if (held := self.engine.active_requests()) is not None:
            m.engine_requests.set(held)
        if (steps := self.engine.steps_run()) is not None:
            m.engine_steps_reached(steps)
        if (ran := self.engine.slot_steps()) is not None:
            m.slot_steps_ran(ran)
        m.time_spent(self.engine.compute_seconds(), self.engine.batch_sizes(), wire.CLOCK.seconds)
        m.sleep_level.set(-1 if (level := self.book.state.asleep) is None else level)
        if (weights := self.engine.weight_bytes()) is not None:
            m.weights_held(weights)
        if (caches := self.engine.prompt_caches) is not None:
            m.prompt_caches.set(len(caches))
            m.follow(m.prompt_cache_reused, caches.reused_tokens, "prompt-cache-reused")
        if (ahead := self.engine.audio_ahead) is not None:
            m.audio_ahead.set(len(ahead))
            m.audio_windows_encoded(ahead.windows_ahead, ahead.windows_late)
