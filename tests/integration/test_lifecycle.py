"""Child-process lifecycle with real spawned processes: READY, ERROR, death, shutdown."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from omni_pipeline.lifecycle import ChildFailed, LifecycleEvent, ManagedProcess, ProcState


def ready_then_wait(ready: Callable[[dict[str, Any]], None], tag: str) -> None:
    ready({"tag": tag, "pid": os.getpid()})
    threading.Event().wait()  # serve until terminated


def fail_at_startup(ready: Callable[[dict[str, Any]], None]) -> None:
    raise ValueError("model directory not found")


def ignore_sigterm(ready: Callable[[dict[str, Any]], None]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready({})
    threading.Event().wait()


def test_ready_info_and_clean_shutdown() -> None:
    events: list[ProcState] = []
    p = ManagedProcess("t", ready_then_wait, ("x",), on_event=lambda _, ev: events.append(ev.state))
    info = p.wait_ready(60)
    assert info["tag"] == "x" and info["pid"] == p.pid
    p.shutdown()
    assert not p.alive
    assert events[:2] == [ProcState.STARTUP, ProcState.READY] and events[-1] is ProcState.DEAD


def test_startup_error_is_reported() -> None:
    p = ManagedProcess("bad", fail_at_startup)
    with pytest.raises(ChildFailed, match="model directory not found"):
        p.wait_ready(60)
    assert p.wait_dead(10) and p.exitcode == 1


def test_death_is_noticed_without_polling() -> None:
    dead = threading.Event()

    def on_event(_: ManagedProcess, ev: LifecycleEvent) -> None:
        if ev.state is ProcState.DEAD:
            dead.set()

    p = ManagedProcess("victim", ready_then_wait, ("y",), on_event=on_event)
    p.wait_ready(60)
    os.kill(p.pid, signal.SIGKILL)
    assert dead.wait(10)
    assert p.exitcode == -signal.SIGKILL


def test_shutdown_kills_what_ignores_sigterm() -> None:
    p = ManagedProcess("stubborn", ignore_sigterm)
    p.wait_ready(60)
    p.shutdown(grace_s=0.5)  # terminate, wait the grace, then kill
    assert not p.alive and p.exitcode == -signal.SIGKILL
    assert not psutil.pid_exists(p.pid)
