"""`omni serve`: the whole pipeline as one process tree on one machine.

The supervisor starts an embedded nats-server (unless given a URL), one process per stage
replica, then the gateway once every stage is READY. A process that dies, the nats-server
included, is restarted with backoff (the nats-server on its own port, so that every client
reconnects by itself; a stage's requests in flight move to a fresh route at the gateway,
which sees the replica's instance change). One that keeps dying soon after each start ends
`omni serve` with a message naming it, rather than a pipeline that answers 503 for ever.
SIGINT/SIGTERM stop everything in order (gateway, stages, NATS) and sweep this deployment's
shared-memory segments, so nothing is left behind. Every process names itself in `ps`.
"""

from __future__ import annotations

import heapq
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from setproctitle import setproctitle

from omni_cli.children import gateway_child, stage_child
from omni_cli.natsd import EmbeddedNats
from omni_pipeline.connectors.shm import DEFAULT_PREFIX, SHM_PREFIX_ENV, ShmConnector
from omni_pipeline.lifecycle import (
    ChildFailed,
    LifecycleEvent,
    ManagedProcess,
    ProcState,
    start_fork_server,
    stop_fork_server,
)
from omni_pipeline.placement import VISIBLE_DEVICES_ENV, PlacementError, place, uses_gpus, visible_gpus
from omni_pipeline.settings import ConnectorSpec
from omni_pipeline.spec import PipelineFile
from omni_stage.preload import stage_modules

log = logging.getLogger("omni.serve")

STARTUP_TIMEOUT_S: Final = 600.0
BACKOFF_START_S: Final = 1.0
BACKOFF_MAX_S: Final = 30.0
STABLE_AFTER_S: Final = 60.0
"""A process that lived this long before dying starts its backoff and its count afresh."""
MAX_QUICK_DEATHS: Final = 5
"""Deaths in a row, each sooner than STABLE_AFTER_S after its start, that end `omni serve`."""
NATS: Final = "nats-server"
GATEWAY_MODULES: Final = ["omni_gateway.app"]
"""What every gateway imports first: the fork server imports it once, with what the pipeline's
stages import (omni_stage.preload)."""
NATS_BACKOFF_START_S: Final = 0.1
"""Every process of the tree waits on NATS: it comes back first, at once."""


class _Stopped(Exception):
    """A signal came while the pipeline was starting: stop instead."""


@dataclass
class _Slot:
    """One supervised process and how to (re)start it."""

    name: str
    target: object
    args: tuple[object, ...]
    env: dict[str, str] = field(default_factory=dict)
    proc: ManagedProcess | None = None
    started_at: float = 0.0
    first_backoff: float = BACKOFF_START_S
    backoff: float = BACKOFF_START_S
    quick_deaths: int = 0


class Supervisor:
    def __init__(self, pipeline: PipelineFile, path: str, host: str, port: int, nats_url: str | None) -> None:
        self.pipeline = pipeline
        self.path = os.path.abspath(path)
        self.host = host
        self.port = port
        self.nats_url = nats_url
        # Under OMNI_SHM_PREFIX when set, so one variable names everything a host runs.
        self.shm_prefix = f"{os.environ.get(SHM_PREFIX_ENV) or DEFAULT_PREFIX}-{uuid.uuid4().hex[:8]}"
        self.shm = ShmConnector("serve", ConnectorSpec(), prefix=self.shm_prefix)  # frees, never writes
        self.events: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self.slots: dict[str, _Slot] = {}
        self.nats: EmbeddedNats | None = None
        # The embedded nats-server's restarts and deaths (it is no ManagedProcess: a binary).
        self.nats_slot = _Slot(
            NATS, None, (), first_backoff=NATS_BACKOFF_START_S, backoff=NATS_BACKOFF_START_S
        )
        self.stopping = False

    def _on_event(self, proc: ManagedProcess, ev: LifecycleEvent) -> None:
        if ev.state in (ProcState.READY, ProcState.DEAD):
            self.events.put((ev.state.value, proc.name))

    def _start(self, slot: _Slot) -> None:
        slot.proc = ManagedProcess(
            slot.name,
            slot.target,
            slot.args,
            on_event=self._on_event,  # type: ignore[arg-type]
            env={SHM_PREFIX_ENV: self.shm_prefix, **slot.env},
        )
        slot.started_at = time.monotonic()

    def run(self) -> int:
        setproctitle(f"omni: supervisor {self.pipeline.name}")
        start_fork_server(stage_modules({s.engine.kind for s in self.pipeline.spec.stages}) + GATEWAY_MODULES)

        def on_signal(signum: int, _frame: object) -> None:
            # Only a word to the loop (or the startup wait), which stops everything in order.
            self.events.put(("signal", signal.Signals(signum).name))

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            self._startup()
        except _Stopped:
            self.shutdown()
            return 0
        except (ChildFailed, TimeoutError, RuntimeError, FileNotFoundError, PlacementError) as exc:
            print(f"omni serve: {exc}", file=sys.stderr)
            self.shutdown()
            return 1
        return self._loop()

    def _startup(self) -> None:
        devices = self._devices()  # before anything starts: a placement that cannot work stops here
        url = self.nats_url
        if not url:
            self._start_nats()
            assert self.nats is not None
            url = self.nats.url
            log.info("embedded nats-server at %s", url)
        log.info("shared memory: /dev/shm/%s-*", self.shm_prefix)
        for stage in self.pipeline.spec.stages:
            for i in range(stage.replicas):
                name = f"{stage.name}-{i}"
                args = (self.path, stage.name, str(i), url)
                self.slots[name] = _Slot(name, stage_child, args, devices.get(name, {}))
        for slot in self.slots.values():
            self._start(slot)
        self._wait_ready(set(self.slots))
        gw_args = (self.path, url, self.host, self.port)
        gw = self.slots["gateway"] = _Slot("gateway", gateway_child, gw_args, devices.get("gateway", {}))
        self._start(gw)
        self._wait_ready({"gateway"})
        assert gw.proc is not None
        info = gw.proc.info
        print(
            f"omni serve: {self.pipeline.spec.served_model_name} ready at http://{self.host}:{info['port']}/v1",
            flush=True,
        )

    def _devices(self) -> dict[str, dict[str, str]]:
        """Each process's CUDA_VISIBLE_DEVICES, once any stage asks for GPUs: a stage replica's own
        among this machine's (a stage with none, and the gateway, see none); PlacementError if
        they do not fit."""
        spec = self.pipeline.spec
        if not uses_gpus(spec):
            return {}
        pod = visible_gpus()
        placement = place(spec, len(pod))
        out = {"gateway": {VISIBLE_DEVICES_ENV: ""}}
        for (stage, i), _ in sorted(placement.devices.items()):
            ids = placement.visible(stage, i, pod)
            out[f"{stage}-{i}"] = {VISIBLE_DEVICES_ENV: ids}
            log.info("%s-%d: GPUs %s", stage, i, ids or "none")
        return out

    def _wait_ready(self, names: set[str]) -> None:
        """Until every named process is READY; the first one to die fails the startup."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(names)
        while waiting:
            try:
                kind, name = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"not ready after {STARTUP_TIMEOUT_S:.0f}s: {', '.join(sorted(waiting))}"
                ) from None
            if kind == "signal":
                raise _Stopped(name)
            proc = self.slots[name].proc if name in self.slots else None
            if kind == ProcState.DEAD.value and proc is not None:
                why = proc.error or f"exited with code {proc.exitcode}"
                raise ChildFailed(f"{name} failed to start: {why}")
            waiting.discard(name)

    def _start_nats(self) -> None:
        """The embedded nats-server, on the port it had before (a restart), with a thread that
        reaps it and tells the loop when it exits."""
        self.nats_slot.started_at = time.monotonic()  # a start that fails counts as a quick death
        videos = self.pipeline.spec.gateway.videos
        jetstream: tuple[str, ...] = ()
        if videos.store == "jetstream":  # video jobs kept in JetStream: its files under the state directory
            jetstream = (
                "--jetstream",
                "--store_dir",
                str(Path(videos.state_dir, self.pipeline.name, "jetstream")),
            )
        server = EmbeddedNats(port=self.nats.port if self.nats else -1, args=jetstream)
        self.nats = server

        def watch() -> None:
            code = server.proc.wait()
            if not self.stopping:
                self.events.put(("exited", f"exit code {code}"))

        threading.Thread(target=watch, name="nats-server-watch", daemon=True).start()

    def _loop(self) -> int:
        restarts: list[tuple[float, str]] = []
        while True:
            timeout = max(0.0, restarts[0][0] - time.monotonic()) if restarts else None
            try:
                kind, what = self.events.get(timeout=timeout)
            except queue.Empty:
                _, name = heapq.heappop(restarts)
                log.info("restarting %s", name)
                if name != NATS:
                    self._start(self.slots[name])
                    continue
                try:
                    self._start_nats()
                except RuntimeError as exc:  # it did not come up: counts as dying at once
                    self.events.put(("exited", str(exc)))
                continue
            if kind == ProcState.READY.value:
                log.info("%s ready", what)
                continue
            if kind == "signal":
                log.info("%s: shutting down", what)
                self.shutdown()
                return 0
            if kind == "exited":  # the nats-server
                slot, why = self.nats_slot, what
            else:
                slot = self.slots[what]
                if slot.proc is None or slot.proc.alive:
                    continue
                if slot.proc.pid is not None:
                    self.shm.release_process(slot.proc.pid)
                why = f"exit code {slot.proc.exitcode}"
            if (failed := self._died(slot, why)) is not None:
                return failed
            heapq.heappush(restarts, (time.monotonic() + slot.backoff, slot.name))
            slot.backoff = min(slot.backoff * 2, BACKOFF_MAX_S)

    def _died(self, slot: _Slot, why: str) -> int | None:
        """Count a death; an exit status for `omni serve` once the process keeps dying, else None."""
        if time.monotonic() - slot.started_at > STABLE_AFTER_S:
            slot.backoff, slot.quick_deaths = slot.first_backoff, 0
        slot.quick_deaths += 1
        if slot.quick_deaths >= MAX_QUICK_DEATHS:
            print(
                f"omni serve: {slot.name} died {slot.quick_deaths} times in a row, each within "
                f"{STABLE_AFTER_S:.0f}s of its start (last: {why}); stopping",
                file=sys.stderr,
                flush=True,
            )
            self.shutdown()
            return 1
        log.error("%s died (%s); restarting in %.1fs", slot.name, why, slot.backoff)
        return None

    def shutdown(self) -> None:
        self.stopping = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gw = self.slots.pop("gateway", None)
        if gw and gw.proc:
            gw.proc.shutdown()
        procs = [s.proc for s in self.slots.values() if s.proc is not None]
        for p in procs:  # SIGTERM all at once, then wait: stages drain in parallel
            p.request_stop()
        for p in procs:
            p.shutdown()
        stop_fork_server()
        if self.nats:
            self.nats.stop()
        self.shm.sweep()
        log.info("stopped")
