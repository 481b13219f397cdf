"""Child-process lifecycle: STARTUP -> READY -> (ERROR) -> SHUTDOWN -> DEAD, as in seed 004.

Children are forked from a fork server (`forkserver`: a clean process, started once, that has
imported what `preload` names and done nothing else: no thread, no CUDA), so a child starts
without importing torch again; each gets its environment from its caller, not the server's.
`omni serve` forks its fork server from itself before it starts anything (`start_fork_server`)
rather than have multiprocessing start a fresh interpreter, which imported again what the
supervisor had.
They report their state over a one-way pipe as wire-encoded structs (bytes, never pickled
objects). A monitor thread per child waits on the pipe and the
process sentinel together, so a death is noticed at once, without polling. Readiness comes
only from the child's READY event. Shutdown is terminate, wait up to 5 s, kill the tree;
what the child started and left behind is killed with it, and the fork server last.

A serving process (a child here, or `omni stage` / `omni gateway` as a pod's main process) ends
the same way in both: once it has stopped serving it has `STOP_DEADLINE_S` to close (`exit_if_stuck`),
and it leaves with `exit_process`, without the interpreter's teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import connection, forkserver, resource_tracker, util
from multiprocessing.connection import Connection, wait
from typing import Any, Final, NoReturn

import msgspec
import psutil
import setproctitle

from omni_pipeline import wire

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S: Final = 5.0
STOP_DEADLINE_S: Final = 20.0
"""How long a process that has stopped serving may take to close its connections and libraries."""
_PR_SET_PDEATHSIG: Final = 1


class ProcState(enum.StrEnum):
    STARTUP = "STARTUP"
    READY = "READY"
    ERROR = "ERROR"
    SHUTDOWN = "SHUTDOWN"
    DEAD = "DEAD"


class LifecycleEvent(msgspec.Struct, frozen=True):
    state: ProcState
    detail: str = ""
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class ChildFailed(RuntimeError):
    """A child reported ERROR or died before it became READY."""


ReadyCallback = Callable[[dict[str, Any]], None]
ChildTarget = Callable[..., None]
"""Called as target(ready, *args) in the child; it calls ready(info) once it can serve."""


def _send(conn: Connection, ev: LifecycleEvent) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):  # the parent is gone: nothing to tell
        conn.send_bytes(wire.encode(ev))


def exit_if_stuck(seconds: float = STOP_DEADLINE_S) -> None:
    """From now on the process has `seconds` to end. If it has not by then (a backend that no
    longer answers, a native library's close, a thread that never returns), every thread's
    stack goes to stderr, which says what held it, and it exits with status 1. The timer is the
    whole process's: only a process's own entry point arms it."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def exit_process(code: int) -> NoReturn:
    """End now, without the interpreter's teardown: it would join threads still inside a
    backend's call (a connector's I/O thread waits out Mooncake's 30 s timeout per call) and run
    half-closed native libraries' destructors. Everything the process owns has been closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _find_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux
    return prctl


_PRCTL: Final = _find_prctl()
"""libc's prctl, looked up on import: `die_with_parent` runs between fork and exec
(`preexec_fn`), where only the forking thread is left, and looking it up there (dlopen) would
wait forever on the loader's lock were another thread of the parent holding it at the fork."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (even by SIGKILL), so a
    killed supervisor never leaves orphans behind. A no-op elsewhere."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


_CONTEXT: Final = mp.get_context("forkserver")
COLLECTOR_OFF: Final = "omni_pipeline.collector_off"
ENDS_WITH_PARENT: Final = "omni_pipeline.ends_with_parent"


def preload(modules: list[str]) -> None:
    """Modules the fork server imports once, before the first child: what every child would
    import anyway. Only modules that start no thread and touch no accelerator on import. They
    are imported with the collector off (`omni_pipeline.collector_off`)."""
    _CONTEXT.set_forkserver_preload([COLLECTOR_OFF, *modules])


def start_fork_server(modules: list[str]) -> None:
    """Start the fork server now, with `modules` (`preload`'s), forked from this process rather
    than started as a fresh interpreter. It imports them then, as a fresh one would; what this
    process has imported already it has for nothing: `omni serve` as the tests run it is forked
    from a server that imported every stage's modules (omni_cli/forked.py), and its fork server
    then imports nothing, where it spent about 5 s of CPU a serve. Called before this process
    starts any thread (a fork copies only the caller's) or opens anything its children must not
    hold: `omni serve`'s first step. What it sets is what multiprocessing's `ensure_running`
    would (`multiprocessing.forkserver._forkserver`'s address, alive pipe and pid, as in
    CPython 3.11); where this interpreter keeps them otherwise, or has the server authenticate
    its callers (a newer CPython), `spawn_fork_server`: multiprocessing starts it afresh, now."""
    server: Any = getattr(forkserver, "_forkserver", None)
    kept = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if not all(hasattr(server, a) for a in kept) or hasattr(server, "_forkserver_authkey"):
        spawn_fork_server(modules)
        return
    preload(modules)
    if server._forkserver_pid is not None:
        return
    assert threading.active_count() == 1, "the fork server is forked before any thread starts"
    resource_tracker.ensure_running()  # the children's, shared through the server as multiprocessing does
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):  # type: ignore[attr-defined]
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w has
        for stream in (sys.stdout, sys.stderr):  # or what they hold is written again by the children
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            _serve_forks(listener.fileno(), alive_r, [COLLECTOR_OFF, *modules], parent)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def spawn_fork_server(modules: list[str]) -> None:
    """Start multiprocessing's own fork server now, a fresh interpreter that imports `modules`
    (`preload`'s) and ends with this process (`omni_pipeline.ends_with_parent`):
    `start_fork_server` where it cannot fork one. Now, from the main thread: Linux signals the
    end of the thread that started the server, not of its process, and multiprocessing would
    start it from whichever thread first started a child."""
    assert threading.current_thread() is threading.main_thread(), "the fork server's parent thread must last"
    _CONTEXT.set_forkserver_preload([COLLECTOR_OFF, ENDS_WITH_PARENT, *modules])
    forkserver.ensure_running()
    # A server that dies is started again by whichever thread starts a child next, which may
    # end before the process: that one is not tied to its parent thread's end.
    preload(modules)


def _serve_forks(listener: int, alive_r: int, modules: list[str], parent: int) -> NoReturn:
    """The forked fork server: multiprocessing's own loop, until the last holder of the alive
    pipe has gone (it then raises SystemExit), without this process's teardown. It ends with
    the supervisor, however that ends: every child holds the alive pipe too, so a supervisor
    killed by SIGKILL (or the OOM killer) left the server and with it every stage running."""
    code = 1
    try:
        die_with_parent()  # and its children with it (theirs is the server)
        if os.getppid() != parent:
            raise SystemExit  # the supervisor died before that took hold
        setproctitle.setproctitle("omni: fork server")
        forkserver.main(listener, alive_r, modules)
    except SystemExit:
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def settle_forked_child(env: dict[str, str]) -> None:
    """What a process forked from a fork server does first, to run as the same program started
    on its own with `env` as its environment (this module's children; the `omni` commands the
    tests and `omni bench` fork, omni_cli/forked.py)."""
    # What the fork server imported (torch, transformers: some 400k objects) lives as long as
    # this process: out of the collector's sight, or every full collection walks all of it
    # again (0.2 s each, several while a stage loads) and writes to every page it shares. The
    # server imported it with the collector off: on again for what this process makes.
    gc.freeze()
    gc.enable()
    # setproctitle finds the memory a title goes in (argv, then the environment's block) on its
    # first call: before the environment changes, or it finds none and titles stay unset.
    setproctitle.getproctitle()
    # The caller's environment, before anything reads it (CUDA_VISIBLE_DEVICES: at CUDA's start).
    for k in os.environ.keys() - env.keys():
        del os.environ[k]
    os.environ.update(env)
    # What the server derived from its own environment: tempfile's directory (TMPDIR), read
    # again at its next use (the server's imports had it read).
    tempfile.tempdir = None
    # Forkserver would otherwise become this process's default start method and keep
    # libraries' semaphores named until exit.
    mp.set_start_method(None, force=True)


def _child_entry(target: ChildTarget, report: Connection, args: tuple[Any, ...], env: dict[str, str]) -> None:
    settle_forked_child(env)
    # Its parent is the fork server, which exits when the supervisor does.
    die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; the supervisor alone decides
    # what it means and tells children with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _send(report, LifecycleEvent(ProcState.STARTUP, info={"pid": os.getpid()}))
    ready_sent = False

    def ready(info: dict[str, Any]) -> None:
        nonlocal ready_sent
        if not ready_sent:
            ready_sent = True
            _send(report, LifecycleEvent(ProcState.READY, info=info))

    code = 0
    try:
        target(ready, *args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException as exc:
        code = 1
        detail = f"{type(exc).__name__}: {exc}"
        log.error("child failed: %s\n%s", detail, traceback.format_exc())
        _send(report, LifecycleEvent(ProcState.ERROR, detail=detail))
    finally:
        _send(report, LifecycleEvent(ProcState.SHUTDOWN))
        report.close()
    exit_process(code)


def kill_tree(pid: int, reap_root: bool = True) -> None:
    """SIGKILL a process and everything under it. With reap_root=False the root (a child whose
    exit status its monitor collects) is killed but not waited for here."""
    try:
        root = psutil.Process(pid)
        below = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in [*below, root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs([*below, root] if reap_root else below, timeout=SHUTDOWN_GRACE_S)


def _exited(proc: mp.process.BaseProcess, timeout_s: float) -> bool:
    """Wait on the process sentinel: sees the exit without reaping (the monitor reaps)."""
    return bool(wait([proc.sentinel], timeout_s))


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _shutdown(proc: mp.process.BaseProcess, grace_s: float, terminated: list[bool]) -> None:
    if _exited(proc, 0) or proc.pid is None:
        return
    # What the child started (vLLM's engine core and its workers): whatever of it outlives the
    # child is killed below. Orphans are no longer under the child by then; psutil's handles
    # still know them, and refuse to kill a pid reused since.
    started = _descendants(proc.pid)
    if not terminated[0]:  # a second SIGTERM means "stop now"; send one only
        terminated[0] = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    if not _exited(proc, grace_s):
        kill_tree(proc.pid, reap_root=False)
        _exited(proc, 2.0)
    for p in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(started, timeout=SHUTDOWN_GRACE_S)


def stop_fork_server() -> None:
    """Kill the fork server once every child is down. Left to notice the supervisor's exit, it
    would run its interpreter's teardown (the stages' modules, torch's among them: seconds, far
    more on a busy machine) after the supervisor is gone, a process of the tree still alive.
    It holds nothing to save. CPython keeps its one fork server, and how to stop and reap it
    (`_stop`, which its own tests use), in `multiprocessing.forkserver._forkserver`."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None:
        return  # never started (or an interpreter that keeps it elsewhere: it ends on its own)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()


class ManagedProcess:
    """A child with a lifecycle: events, readiness, death monitoring, shutdown."""

    def __init__(
        self,
        name: str,
        target: ChildTarget,
        args: tuple[Any, ...] = (),
        on_event: Callable[[ManagedProcess, LifecycleEvent], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.state = ProcState.STARTUP
        self.info: dict[str, Any] = {}
        self.error = ""
        self.exitcode: int | None = None
        self._on_event = on_event
        self._changed = threading.Condition()
        reader, writer = _CONTEXT.Pipe(duplex=False)
        self._reader = reader
        # The fork server's environment is the one it started with: the child's own comes along.
        child_env = {**os.environ, **(env or {})}
        self.process = _CONTEXT.Process(
            target=_child_entry, args=(target, writer, args, child_env), name=name
        )
        self.process.start()
        writer.close()
        self.pid = self.process.pid
        self._terminated = [False]
        self._finalizer = weakref.finalize(self, _shutdown, self.process, SHUTDOWN_GRACE_S, self._terminated)
        self._monitor = threading.Thread(
            target=_monitor,
            args=(weakref.ref(self), reader, self.process),
            name=f"monitor-{name}",
            daemon=True,
        )
        self._monitor.start()

    def _record(self, ev: LifecycleEvent) -> None:
        with self._changed:
            if self.state is ProcState.DEAD:
                return
            if ev.state is ProcState.ERROR:
                self.error = ev.detail
            if ev.state is ProcState.READY:
                self.info = ev.info
            if ev.state is ProcState.DEAD:
                self.exitcode = self.process.exitcode
            self.state = ev.state
            self._changed.notify_all()
        if self._on_event:
            self._on_event(self, ev)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Block until READY; raise ChildFailed on ERROR/death, TimeoutError on timeout."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self.state in (ProcState.READY, ProcState.ERROR, ProcState.SHUTDOWN, ProcState.DEAD),
                timeout_s,
            )
            if not ok:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s")
            if self.state is not ProcState.READY:
                why = self.error or f"exited with code {self.process.exitcode}"
                raise ChildFailed(f"{self.name} failed to start: {why}")
            return self.info

    def wait_dead(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.state is ProcState.DEAD, timeout_s)

    @property
    def alive(self) -> bool:
        return self.state is not ProcState.DEAD

    def request_stop(self) -> None:
        """SIGTERM once, without waiting (to stop many children in parallel)."""
        if not self._terminated[0] and not _exited(self.process, 0) and self.pid is not None:
            self._terminated[0] = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """SIGTERM, wait `grace_s`, then SIGKILL the tree. Idempotent."""
        if self._finalizer.alive:
            self._finalizer.detach()
            _shutdown(self.process, grace_s, self._terminated)
        self.wait_dead(2.0)


def _monitor(ref: weakref.ref[ManagedProcess], reader: Connection, process: mp.process.BaseProcess) -> None:
    """Forward the child's events; reap it and report DEAD when its sentinel fires.

    Holds the process, not the ManagedProcess (so that one can be collected and finalized)."""
    sentinel = process.sentinel
    watch: list[Any] = [reader, sentinel]
    while True:
        ready = wait(watch)
        if reader in ready:
            try:
                data = reader.recv_bytes()
            except (EOFError, OSError):
                watch.remove(reader)
                continue
            try:
                ev = wire.decode(data, LifecycleEvent)
            except wire.WireError:
                log.error("child sent an undecodable lifecycle event; ignoring it")
                continue
            if (m := ref()) is not None:
                m._record(ev)
            continue
        if sentinel in ready:
            # Drain what the child said before dying (its ERROR detail), then report death.
            while reader in watch and reader.poll():
                try:
                    ev = wire.decode(reader.recv_bytes(), LifecycleEvent)
                except (EOFError, OSError, wire.WireError):
                    break
                if (m := ref()) is not None:
                    m._record(ev)
            reader.close()
            # This thread alone reaps the child (everything else waits on the sentinel), so the
            # exit code is never lost to another thread's waitpid.
            process.join()
            if (m := ref()) is not None:
                m._record(LifecycleEvent(ProcState.DEAD, detail=f"exit code {process.exitcode}"))
            return
