"""Child-process lifecycle with real processes (forked from the fork server): READY, ERROR,
death, shutdown, and the environment and title each child has."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from setproctitle import getproctitle, setproctitle

from omni_pipeline.lifecycle import (
    ChildFailed,
    LifecycleEvent,
    ManagedProcess,
    ProcState,
    preload,
    stop_fork_server,
)
from tests.helpers import ROOT, ended, wait_for


def ready_then_wait(ready: Callable[[dict[str, Any]], None], tag: str) -> None:
    ready({"tag": tag, "pid": os.getpid()})
    threading.Event().wait()  # serve until terminated


def report_environment(ready: Callable[[dict[str, Any]], None], names: list[str]) -> None:
    setproctitle("omni: test child")
    ready({"env": {n: os.environ.get(n) for n in names}, "title": getproctitle()})
    threading.Event().wait()


def leave_a_grandchild(ready: Callable[[dict[str, Any]], None]) -> None:
    """Starts a process of its own and dies at SIGTERM without stopping it, as a library's
    engine process outlives a stage that ended without closing it."""
    grandchild = subprocess.Popen(["sleep", "600"])
    ready({"grandchild": grandchild.pid})
    threading.Event().wait()


def report_collector(ready: Callable[[dict[str, Any]], None]) -> None:
    ready({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()})
    threading.Event().wait()


def report_modules(ready: Callable[[dict[str, Any]], None], names: list[str]) -> None:
    server = psutil.Process().parent()
    imported = [n for n in names if n in sys.modules]
    ready(
        {
            "imported": imported,
            "server": [server.pid, " ".join(server.cmdline()).strip(), server.ppid()],
            "tmp": tempfile.gettempdir(),
        }
    )
    threading.Event().wait()


FORKS_ITS_SERVER = """
import json, sys, tempfile, wave
from omni_pipeline.lifecycle import ManagedProcess, start_fork_server
from tests.integration.test_lifecycle import report_modules
tempfile.gettempdir()  # read here, before the server is forked: the child reads its own again
start_fork_server(["colorsys"])
p = ManagedProcess("child", report_modules, (["wave", "colorsys"],), env={"TMPDIR": sys.argv[1]})
try:
    print(json.dumps(p.wait_ready(60)))
finally:
    p.shutdown()
"""


SERVES_UNTIL_KILLED = """
import json, threading
from omni_pipeline.lifecycle import ManagedProcess, spawn_fork_server, start_fork_server
from tests.integration.test_lifecycle import ready_then_wait
{start}([])
p = ManagedProcess("child", ready_then_wait, ("a",))
print(json.dumps(p.wait_ready(60)), flush=True)
threading.Event().wait()
"""


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


def test_what_a_child_started_and_left_behind_is_killed_with_it() -> None:
    p = ManagedProcess("parent", leave_a_grandchild)
    grandchild = psutil.Process(p.wait_ready(60)["grandchild"])
    p.shutdown()
    assert not p.alive and p.exitcode == -signal.SIGTERM  # it died of the SIGTERM, leaving `sleep`
    assert not grandchild.is_running()


def test_the_fork_server_is_stopped_at_once_and_starts_again_when_needed() -> None:
    first = ManagedProcess("first", ready_then_wait, ("a",))
    first.wait_ready(60)
    server = psutil.Process(first.pid).parent()
    first.shutdown()
    stop_fork_server()
    assert not server.is_running()
    second = ManagedProcess("second", ready_then_wait, ("b",))  # a new fork server serves it
    try:
        assert second.wait_ready(60)["tag"] == "b"
        assert psutil.Process(second.pid).parent().pid != server.pid
    finally:
        second.shutdown()


def test_a_child_has_its_callers_environment_of_now_and_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps the environment it started with; a child started later gets the
    caller's, as it is when the child starts, with its own additions, and can set its title."""
    first = ManagedProcess("first", ready_then_wait, ("a",))  # the fork server runs by now
    try:
        first.wait_ready(60)
        monkeypatch.setenv("OMNI_TEST_LATER", "set after the fork server started")
        names = ["OMNI_TEST_LATER", "OMNI_TEST_OWN"]
        child = ManagedProcess("second", report_environment, (names,), env={"OMNI_TEST_OWN": "its own"})
        try:
            info = child.wait_ready(60)
        finally:
            child.shutdown()
    finally:
        first.shutdown()
    assert info["env"] == {"OMNI_TEST_LATER": "set after the fork server started", "OMNI_TEST_OWN": "its own"}
    assert info["title"] == "omni: test child"


def test_a_fork_server_forked_from_its_caller_has_what_it_imported(tmp_path: Path) -> None:
    """`omni serve`'s: forked from the supervisor before it starts anything (a fresh process
    here, as the command line starts it), it has what the supervisor imported, imports what
    it is given, titles itself, and ends with its caller. A child gets its caller's TMPDIR,
    not the directory the server had read."""
    out = subprocess.run(
        [sys.executable, "-c", FORKS_ITS_SERVER, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.splitlines()[-1])
    pid, title, parent = info["server"]
    assert info["imported"] == ["wave", "colorsys"] and title == "omni: fork server"
    assert info["tmp"] == str(tmp_path)
    wait_for(lambda: ended(pid), 30, "the fork server to end with its caller")
    assert parent != os.getpid()  # the caller's, not this one's


@pytest.mark.parametrize("start", ["start_fork_server", "spawn_fork_server"])
def test_a_supervisor_killed_takes_its_fork_server_and_children_with_it(start: str) -> None:
    """SIGKILL (or the OOM killer) of the process that started the fork server: the server gets
    SIGTERM from Linux, and its children theirs from it. Every child holds the server's alive
    pipe, so the server alone would have outlived its supervisor, and every stage with it. The
    same where multiprocessing starts the server, a fresh interpreter (`spawn_fork_server`: what
    `start_fork_server` falls back to on a Python that keeps its server otherwise)."""
    caller = subprocess.Popen(
        [sys.executable, "-c", SERVES_UNTIL_KILLED.format(start=start)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert caller.stdout is not None
        child = psutil.Process(json.loads(caller.stdout.readline())["pid"])
        server = child.parent()
        assert server is not None and server.ppid() == caller.pid
    finally:
        caller.kill()
        caller.wait(10)
    try:
        wait_for(lambda: ended(server.pid) and ended(child.pid), 30, "the fork server and its child to end")
    finally:  # a failure leaves nothing running either
        for left in (child, server):
            with contextlib.suppress(psutil.NoSuchProcess):
                left.kill()


def test_a_child_collects_its_garbage_with_what_it_inherited_frozen() -> None:
    """The fork server imports with the collector off (`omni_pipeline.collector_off`); a child
    turns it on again, what it inherited frozen out of its sight."""
    preload(["json"])  # read if this starts the server; one already running was given the same
    p = ManagedProcess("gc", report_collector)
    try:
        info = p.wait_ready(60)
    finally:
        p.shutdown()
    assert info["enabled"] and info["frozen"] > 0, info
