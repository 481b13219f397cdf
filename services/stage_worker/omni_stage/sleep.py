"""Sleep and wake: a replica that stays up and beating while its engine frees its memory.

Asked by the control subject (SleepMsg, WakeMsg) or by the stage's `paused` in the pipeline
file, which the replica rereads while it runs (Kubernetes updates a mounted ConfigMap in place).
Going to sleep stops admitting, ends what the replica holds (`abort`: fails it; `wait`: lets it
finish), then has the engine free memory by the level asked; waking restores it. One sleep or
wake at a time, in the order asked; each answers with a SleepAck saying what it freed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from omni_pipeline.control import ErrorCode, SleepAck
from omni_pipeline.spec import SpecError, load_pipeline
from omni_stage.engines.base import Engine
from omni_stage.metrics import StageMetrics
from omni_stage.outbox import Outbox
from omni_stage.requests import RequestBook
from omni_stage.state import Change, Phase

log = logging.getLogger("omni.stage")


@dataclass(frozen=True, slots=True)
class _Held:
    """What a replica held when a sleep or wake began (its ack reports the difference)."""

    at: float
    rss: int
    weights: dict[str, int] | None


@dataclass(kw_only=True, eq=False)
class SleepControl:
    """One replica's sleeps and wakes."""

    book: RequestBook
    engine: Engine
    outbox: Outbox
    metrics: StageMetrics
    instance: str
    pipeline_path: str | None
    """The file the pipeline was read from, reread for the stage's `paused` while we run."""
    paused: bool
    announce: Callable[[], Awaitable[None]]
    """Beat now: gateways learn of a sleep or wake at once, not at the next beat."""
    abort: Callable[[str], None]
    engine_failed: Callable[[str], None]
    """The engine is in no known state: the replica fails what it holds and exits."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    """One sleep or wake at a time, in the order asked."""
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _stamp: tuple[int, int, int] | None = field(init=False)
    """The pipeline file's stamp when last read."""

    def __post_init__(self) -> None:
        self._stamp = file_stamp(self.pipeline_path)

    @property
    def name(self) -> str:
        return f"{self.book.spec.name}/{self.outbox.replica}"

    def idle(self) -> None:
        """The replica holds nothing any more (a sleep waiting for that goes on)."""
        self._idle.set()

    def spawn(self, work: Coroutine[Any, Any, SleepAck], reply: str | None = None) -> None:
        """Run a sleep or wake in a task of its own (a sleep that waits for requests to finish
        must not hold up the subscription a wake comes on), answering `reply` when done."""

        async def run() -> None:
            await self.outbox.reply(reply, await work)

        task = asyncio.get_running_loop().create_task(run(), name="sleep-or-wake")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def sleep(self, level: int, mode: str) -> SleepAck:
        """Stop admitting, end what the replica holds (`abort`: fail it; `wait`: let it finish),
        then have the engine free memory by `level`. Asleep already (as deep or deeper): done."""
        async with self._lock:
            before = self._held_now()
            if level > self.engine.max_sleep_level:
                why = f"its engine can sleep at most at level {self.engine.max_sleep_level}"
                return self._ack(False, before, why)
            state = self.book.state
            if state.phase not in (Phase.STARTING, Phase.READY, Phase.SLEEPING):
                return self._ack(False, before, f"the replica is {state.phase}")
            if state.asleep is not None and state.asleep >= level:
                return self._ack(True, before)
            log.info("stage %s: going to sleep (level %d, %s)", self.name, level, mode)
            state.change(Change.SLEEP, level=level)
            await self.announce()  # gateways stop routing here now, not at the next beat
            if mode == "abort":
                why = f"stage '{self.book.spec.name}' replica {self.outbox.replica} was put to sleep"
                for st in list(self.book.requests.values()):
                    await self.outbox.fail(st.ctx, f"{why} while serving this request", ErrorCode.SLEEPING)
                    self.abort(st.request_id)
            self._idle.clear()
            if self.book.has_work():
                await self._idle.wait()
            try:
                await self.engine.sleep(level)
            except Exception as exc:
                self.engine_failed(f"sleep at level {level} failed: {type(exc).__name__}: {exc}")
                return self._ack(False, before, str(exc))
            log.info("stage %s: asleep at level %d", self.name, level)
            return self._ack(True, before)

    async def wake(self) -> SleepAck:
        """Restore what the sleep freed and admit again. Awake already: done."""
        async with self._lock:
            before = self._held_now()
            if (level := self.book.state.asleep) is not None:
                try:
                    await self.engine.wake_up(level)
                except Exception as exc:
                    self.engine_failed(f"waking from level {level} failed: {type(exc).__name__}: {exc}")
                    return self._ack(False, before, str(exc))
                self.book.state.change(Change.WAKE)
                log.info("stage %s: awake", self.name)
                await self.announce()
            return self._ack(True, before)

    async def follow_paused(self) -> None:
        """Sleep or wake when the stage's `paused` in the pipeline file changed (nothing else in
        it applies before a restart)."""
        if self.pipeline_path is None or (stamp := file_stamp(self.pipeline_path)) == self._stamp:
            return
        self._stamp = stamp
        stage = self.book.spec.name
        try:
            paused = (await asyncio.to_thread(load_pipeline, self.pipeline_path)).spec.stage(stage).paused
        except (SpecError, KeyError) as exc:
            log.warning("stage %s: pipeline file changed, unreadable for now: %s", stage, exc)
            return
        if paused != self.paused:
            self.paused = paused
            log.info("stage %s: paused set %s in %s", self.name, paused, self.pipeline_path)
            self.spawn(self.sleep(self.engine.max_sleep_level, "wait") if paused else self.wake())

    def _held_now(self) -> _Held:
        return _Held(time.monotonic(), self.metrics.resources.resident_bytes(), self.engine.weight_bytes())

    def _ack(self, ok: bool, before: _Held, message: str = "") -> SleepAck:
        freed = 0  # what left each device (weights moved to host memory left the accelerator)
        if before.weights is not None and (after := self.engine.weight_bytes()) is not None:
            freed = sum(max(0, n - after.get(device, 0)) for device, n in before.weights.items())
        return SleepAck(
            stage=self.book.spec.name,
            replica=self.outbox.replica,
            instance=self.instance,
            ok=ok,
            asleep=self.book.state.asleep,
            seconds=time.monotonic() - before.at,
            freed_bytes=freed,
            rss_bytes_before=before.rss,
            rss_bytes_after=self.metrics.resources.resident_bytes(),
            message=message,
        )


def file_stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells a file's new content from its old: inode (Kubernetes swaps a ConfigMap's files
    by symlink), modification time, size."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
