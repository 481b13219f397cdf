"""`omni` commands forked from a fork server that has imported them, rather than started as
fresh interpreters, as `omni serve` forks its stages (omni_pipeline.lifecycle): a fresh one
spends 2-3 s of CPU importing torch, transformers and the service before its first line, and
its `omni serve`'s fork server 3-6 s more importing what the stages import; forked from a
process that has them, neither imports anything. `omni bench` forks the pipelines it measures
this way (bench/procs.py), from a fork server forked from itself, and the tests their `omni
stage`, `omni gateway`, `omni serve` and `omni bench` (tests/helpers.py), from a server that
imported `PRELOAD` once. What runs is the command line's own `main` with the caller's arguments,
working directory, environment (the caller's, none of the server's) and log file, in a process
group of its own, as `subprocess.Popen(..., start_new_session=True)` would run it, ending with
its parent (the server, which ends with its caller). Every module an omni process imports reads
the environment when called, never at import (tempfile's directory, which the imports read, is
forgotten: `lifecycle.settle_forked_child`): that is what lets `omni serve` fork its stages this
way too."""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Final

from omni_cli.serve import GATEWAY_MODULES
from omni_pipeline.lifecycle import die_with_parent, preload, settle_forked_child
from omni_pipeline.spec import EngineKind
from omni_stage.preload import stage_modules

PRELOAD: Final = ["omni_cli.main", *stage_modules(EngineKind), *GATEWAY_MODULES]
"""What the server imports before its first child: what `omni serve`'s fork server imports for
a pipeline of every engine kind."""
_CONTEXT: Final = mp.get_context("forkserver")
_STARTED_S: Final = 30
"""How long a child may take to stand in its own process group: milliseconds on an idle machine."""
_LIVE: Final[set[ForkedProcess]] = set()


def _run(argv: list[str], cwd: str, env: dict[str, str], log: str, stdout: str, started: Connection) -> None:
    """The child: its own session, the caller's directory and environment, its output to `log`
    (standard output to `stdout`), then `omni ARGV`'s main; its return is the exit status."""
    settle_forked_child(env)
    die_with_parent()  # the server, which ends with its caller: a caller killed runs no `finally`
    os.setsid()
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python -m omni_cli.main` run there has it
    for path, to in ((stdout, 1), (log, 2)):  # both appended to: one file, if they are the same
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, to)
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    started.send(os.getpid())
    started.close()
    sys.argv = ["omni", *argv]
    from omni_cli.main import main

    sys.exit(main(argv))


class ForkedProcess:
    """What the tests and the benchmarks use of `subprocess.Popen`, for an `omni` command forked
    from the server."""

    def __init__(
        self, argv: list[str], cwd: Path, env: dict[str, str], log: Path, stdout: Path | None = None
    ) -> None:
        self.args = argv
        preload(PRELOAD)  # read when the server starts: the first child
        reader, writer = _CONTEXT.Pipe(duplex=False)
        out = str(stdout or log)
        self._process = _CONTEXT.Process(
            target=_run, args=(argv, str(cwd), env, str(log), out, writer), name=f"omni {argv[0]}"
        )
        self._process.start()
        writer.close()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        _LIVE.add(self)
        try:
            if not reader.poll(_STARTED_S):
                raise RuntimeError(f"omni {argv[0]}: not started in {_STARTED_S} s")
            reader.recv()  # in its own session now: its pid is its process group
        except EOFError:
            pass  # it exited before: poll() says how
        finally:
            reader.close()

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            _LIVE.discard(self)
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@atexit.register
def _kill_left_behind() -> None:
    """A test or a benchmark that failed before stopping its processes leaves none behind (and
    multiprocessing's own exit would otherwise wait for them)."""
    for p in list(_LIVE):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            p.wait(10)
