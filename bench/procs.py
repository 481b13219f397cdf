"""The processes a benchmark runs against: `omni serve` or `omni stage` on a pipeline written
to a temporary directory, stopped (with everything they started) when the block ends. They are
forked (omni_cli.forked) from `omni bench`'s fork server, which has what `omni bench` imported
(omni_cli.main's `cmd_bench`); run as `python -m bench.NAME`, from one multiprocessing starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import yaml

from omni_cli.forked import ForkedProcess

FILE: Final = "<pipeline file>"
ROOT: Final = Path(__file__).resolve().parents[1]


DEMO_DIR_ENV: Final = "OMNI_DEMO_DIR"
"""A directory whose models/ init-demo wrote (the tests' own), used instead of building one."""


@contextlib.contextmanager
def demo_models() -> Iterator[Path]:
    """A directory holding models/ with every demo model: $OMNI_DEMO_DIR's, the checkout's, else
    one built for the block."""
    for given in (os.environ.get(DEMO_DIR_ENV), ROOT):
        if given and (Path(given) / "models" / "tiny-image" / "model_index.json").exists():  # written last
            yield Path(given)
            return
    from omni_stage.demo import init_demo

    with tempfile.TemporaryDirectory() as tmp:
        init_demo(Path(tmp) / "models")
        yield Path(tmp)


def pipeline_file(directory: Path, name: str, spec: dict[str, Any]) -> Path:
    path = directory / f"{name}.yaml"
    doc = {"apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": name}}
    path.write_text(yaml.safe_dump({**doc, "spec": spec}, sort_keys=False))
    return path


def _wait_output(proc: ForkedProcess, log: Path, pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if m := re.search(pattern, log.read_text(errors="replace")):
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.1)  # polling a log file: the process has no other readiness signal for us
    raise RuntimeError(f"omni {' '.join(proc.args)} not ready:\n{log.read_text()[-3000:]}")


def _stop(proc: ForkedProcess, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def _omni(
    name: str,
    spec: dict[str, Any],
    args: list[str],
    ready: str,
    stop: int,
    cwd: Path | None,
    timeout_s: float,
) -> Iterator[re.Match[str]]:
    """`omni <args>` with FILE in `args` standing for `spec` written to a file; yields the match
    of `ready` in its output, and stops it (and all it started) with signal `stop` afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pipeline_file(Path(tmp), name, spec)
        log = Path(tmp) / "omni.log"
        argv = [str(path) if a is FILE else a for a in args]
        proc = ForkedProcess(argv, cwd or Path.cwd(), dict(os.environ), log)
        try:
            yield _wait_output(proc, log, ready, timeout_s)
        finally:
            _stop(proc, stop)


@contextlib.contextmanager
def served(
    name: str, spec: dict[str, Any], cwd: Path | None = None, nats_url: str | None = None
) -> Iterator[str]:
    """`omni serve` of `spec` (on `nats_url`, else its own embedded NATS); yields the gateway's
    base URL (http://127.0.0.1:PORT)."""
    args = ["serve", FILE, "--port", "0", *(["--nats", nats_url] if nats_url else [])]
    ready = r"ready at (http://127\.0\.0\.1:\d+)/v1"
    with _omni(name, spec, args, ready, signal.SIGINT, cwd, 300) as m:
        yield m.group(1)


@contextlib.contextmanager
def stage(name: str, spec: dict[str, Any], stage_name: str, nats_url: str) -> Iterator[None]:
    """`omni stage` for replica 0 of one stage of `spec`, ready when the block starts."""
    args = ["stage", "--pipeline", FILE, "--stage", stage_name, "--nats", nats_url]
    with _omni(name, spec, args, rf"stage {stage_name}/0 ready", signal.SIGTERM, None, 120):
        yield
