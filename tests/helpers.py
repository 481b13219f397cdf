"""Test helpers: waiting on conditions with deadlines, and running omni processes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import httpx
import numpy as np
import openai
import psutil
import soundfile as sf
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from omni_cli.forked import ForkedProcess

if TYPE_CHECKING:
    from omni_stage.engines.base import Engine

T = TypeVar("T")

HTTP: Final = httpx.Client(timeout=5, limits=httpx.Limits(keepalive_expiry=1.0))
"""The tests' one client for their own HTTP calls. `httpx.get` builds a client, and with it a TLS
context loaded with certifi's CAs, on every call: 25 ms of CPU, half a core for a wait that polls
every 50 ms, taken from the processes it waits for. A connection idle for a second is not used
again: uvicorn closes one idle for 5 s, and a request sent as it closes would be lost."""

ROOT = Path(__file__).parents[1]
OMNI = [sys.executable, "-m", "omni_cli.main"]
FORKED_COMMANDS: Final = frozenset({"stage", "gateway", "serve"})
"""The commands `OmniProcess` forks (omni_cli.forked): those whose imports are the cost. The
operator imports kopf and the kubernetes client, not these."""
VLLM_TIMEOUT_S = 600
"""The timeout of a test that starts vLLM's engine on the CPU (its engine core process, the
model loaded and profiled: a minute alone, up to three under a full suite's load)."""
SERVES_QWEN_TIMEOUT_S = 450
"""The timeout of the test that a module's Qwen pipeline starts for (its stages loaded, warmed
up, and the reference generated beside it): a minute and a half under a full suite's load."""
COMPILE_TIMEOUT_S = 1800
"""The timeout of a test that torch.compiles a model on the CPU: inductor builds each graph
with g++, every form the stage runs compiled at start (a minute and a half alone for token2wav
on two cores with a cold cache; up to four under a full suite's load on a slow machine), after
waiting its turn behind the other compile tests (`one_compile_at_a_time`: up to their two
durations), and a third of the timeout kept free."""
SOAK_TIMEOUT_S = 600
"""The timeout of a test that sends a pipeline a thousand requests or more (70 s alone; up to
three minutes under a full suite's load)."""
PIPELINE_RESTARTS_TIMEOUT_S = 450
"""The timeout of a test that starts `omni serve` two or three times over (its gateway or the
whole tree stopped and started again): up to two and a half minutes under a full suite's load."""

SHM_SESSION = os.environ["OMNI_SHM_PREFIX"] = f"omni-run{uuid.uuid4().hex[:8]}"
"""This test process's shared memory: set before any process starts, so everything it makes
(its own connectors, every omni process it starts, which inherit the variable) is named under
it. It never sees another's segments: another run's (such as those a run killed mid-test
leaves), or another pytest-xdist worker's of the same run (each worker sets its own)."""


def shm_prefix(name: str) -> str:
    """A prefix of the run's own, for a test that counts segments apart from the rest."""
    return f"{SHM_SESSION}-{name}"


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
"""A tool, in OpenAI's shape, whose arguments a constrained tiny model can finish."""


REFUSED_CHAT: list[tuple[dict[str, Any], str, str]] = [
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not served by this server"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "not served by this server"),
    ({"verbosity": "high"}, "verbosity", "not served by this server"),
    ({"web_search_options": {}}, "web_search_options", "not served by this server"),
    ({"functions": [{"name": "f"}]}, "functions", "not served by this server"),
    ({"function_call": "auto"}, "function_call", "not served by this server"),
    (
        {"stream_options": {"include_continuous_usage": True}},  # vLLM's is continuous_usage_stats
        "stream_options.include_continuous_usage",
        "unrecognized",
    ),
]
"""Chat fields no engine here serves: (body, the `param` of the 400, what its message says), for
every pipeline kind's refusal test."""


def ended(pid: int) -> bool:
    """Gone, or a zombie whoever it was left to has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `pred` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as exc:  # the condition may not be checkable yet (server starting)
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


async def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """`wait_for` for async tests: polls without blocking the event loop the code under test runs on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def asked_while_held(
    engine: Any, batcher: Any, asks: list[Awaitable[Any]], built_on_compute: bool = False
) -> list[Any]:
    """`asks` (each a request to `engine`) started at once while the engine's compute thread is
    held, and let go once `batcher` holds one piece of each (the first handed to the held
    thread, the others waiting behind it: they go as one batch next); what each gave, or its
    error. `built_on_compute`: the requests build their prompts on the compute thread (with
    the model's weights), so a first hold keeps the builds queued, a second the pieces."""
    compute, loop = engine._compute, asyncio.get_running_loop()
    builds, pieces = threading.Event(), threading.Event()
    held = [loop.run_in_executor(compute, (builds if built_on_compute else pieces).wait)]
    try:
        asking = [asyncio.ensure_future(a) for a in asks]
        if built_on_compute:
            await wait_until(
                lambda: compute._work_queue.qsize() == len(asks), 30, "the prompts' builds queued"
            )
            held.append(loop.run_in_executor(compute, pieces.wait))
            builds.set()
        await wait_until(
            lambda: batcher.occupancy() * batcher.max_batch == len(asks), 30, "a piece of each request queued"
        )
    finally:  # (never a compute thread held past the test)
        builds.set()
        pieces.set()
    done = await asyncio.gather(*asking, return_exceptions=True)
    await asyncio.gather(*held)
    return list(done)


@contextlib.contextmanager
def logits_positions(head: Any) -> Iterator[list[int]]:
    """The positions of each forward's logits that `head` (a model's logits' module) computed
    while within, as its output says (dim 1), seen by a forward hook on it: the module's own
    call, not ours."""
    seen: list[int] = []
    handle = head.register_forward_hook(lambda _module, _args, out: seen.append(int(out.shape[1])))
    try:
        yield seen
    finally:
        handle.remove()


def ran(batcher: Any, before: Counter[Any], key: Any = None) -> list[int]:
    """The sizes of the batches `batcher` ran whole since `before` (a copy of its `calls`), of
    `key` where given."""
    calls = batcher.calls - before
    return sorted(size for (k, size), n in calls.items() if key is None or k == key for _ in range(n))


def sse_data(body: str) -> list[Any]:
    """The JSON of each `data:` line of an SSE body, `[DONE]` left out."""
    return [
        json.loads(line.removeprefix("data: "))
        for line in body.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def vllm_omni_client(
    base: str, model: str, requests: int, max_tokens: int, extras: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """bench.vllm_omni's run of vLLM-Omni's own benchmark client; skips the test where its
    virtualenv was not built (`make test` builds it)."""
    import pytest

    from bench.vllm_omni import VLLM_OMNI_PYTHON
    from bench.vllm_omni import vllm_omni_client as run

    if not VLLM_OMNI_PYTHON.exists():
        pytest.skip(f"{VLLM_OMNI_PYTHON} is missing: `make vllm-omni-venv` (or `make test`) builds it")
    return run(base, model, requests, max_tokens, extras)


def vllm_omni_duplex_client(
    ws_url: str, model: str, pcm: Path, rate: int, voice: str, tokens: int, long_tokens: int
) -> dict[str, Any]:
    """scripts/vllm_omni_duplex_client.py: vLLM-Omni's DuplexClient, through a relay it cuts once,
    in vLLM-Omni's own virtualenv; what it saw. Skips the test where that virtualenv was not
    built (`make test` builds it)."""
    import pytest

    from bench.vllm_omni import VLLM_OMNI_PYTHON

    if not VLLM_OMNI_PYTHON.exists():
        pytest.skip(f"{VLLM_OMNI_PYTHON} is missing: `make vllm-omni-venv` (or `make test`) builds it")
    argv = [str(VLLM_OMNI_PYTHON), str(ROOT / "scripts" / "vllm_omni_duplex_client.py"), ws_url, model]
    argv += [str(pcm), str(rate), voice, str(tokens), str(long_tokens)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours would shadow its vLLM
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, f"vLLM-Omni's duplex client failed: {done.stderr[-3000:]}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def vllm_bench_serve(base: str, model: str, tokenizer: Path, out_dir: Path, **kw: Any) -> dict[str, Any]:
    """bench.vllm_omni's run of vLLM-Omni's CLI (`vllm bench serve --omni`); skips the test
    where its virtualenv was not built (`make test` builds it)."""
    import pytest

    from bench.vllm_omni import VLLM_OMNI_PYTHON
    from bench.vllm_omni import vllm_bench_serve as run

    if not VLLM_OMNI_PYTHON.exists():
        pytest.skip(f"{VLLM_OMNI_PYTHON} is missing: `make vllm-omni-venv` (or `make test`) builds it")
    return run(base, model, tokenizer, out_dir, **kw)


def video_file(frames: np.ndarray, fps: int, audio_seconds: float = 0.0) -> bytes:
    """RGB frames [T, H, W, 3] as FFV1 in Matroska: lossless, so decoding gives them back. With
    `audio_seconds`, a 16 kHz PCM track of that length beside them."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        audio = container.add_stream("pcm_s16le", rate=16000, layout="mono") if audio_seconds else None
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
        if audio is not None:
            pcm = np.zeros((1, int(audio_seconds * 16000)), np.int16)
            for at in range(0, pcm.shape[1], 1600):
                chunk = av.AudioFrame.from_ndarray(pcm[:, at : at + 1600], format="s16", layout="mono")
                chunk.sample_rate, chunk.pts = 16000, at
                container.mux(audio.encode(chunk))
            container.mux(audio.encode())
    return out.getvalue()


def example_stage(example: Path, stage: str, model: Path, **args: Any) -> Engine:
    """Stage `stage` of the pipeline file `example`, on `model`, built in this process as the
    stage's worker builds it: its engine's arguments with `args` over them."""
    from omni_pipeline.spec import load_pipeline
    from omni_stage.engines.registry import build_engine

    spec = load_pipeline(example).spec.stage(stage)
    eng = spec.engine.model_copy(update={"model": str(model), "args": {**spec.engine.args, **args}})
    return build_engine(spec.model_copy(update={"engine": eng}))


def decode_wav(data: str) -> tuple[np.ndarray, int]:
    """The samples and sample rate of a base64 WAV, as the gateway returns `message.audio.data`."""
    samples, rate = sf.read(io.BytesIO(base64.b64decode(data)))
    return samples, int(rate)


def our_shm_segments(prefix: str = SHM_SESSION) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


def shm_segments_in_use(prefix: str = SHM_SESSION) -> list[str]:
    """Segments some request holds; free ones stay pooled while their owner lives."""
    return [name for name in our_shm_segments(prefix) if "-@free-" not in name]


class OmniProcess:
    """An `omni ...` process in its own process group, with its output in a log file: `omni stage`,
    `omni gateway` and `omni serve` forked from a server that has imported them (omni_cli.forked),
    the others started afresh."""

    def __init__(self, args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> None:
        n = 1
        while log.exists():  # a process restarted under the same name: keep its predecessor's log
            log = log.with_name(f"{log.stem.split('~')[0]}~{n}{log.suffix}")
            n += 1
        self.log = log
        self._fh = log.open("w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._terminated = False
        self.proc: subprocess.Popen[bytes] | ForkedProcess
        if args[0] in FORKED_COMMANDS:
            self.proc = ForkedProcess(args, cwd, full_env, log)
        else:
            self.proc = subprocess.Popen(
                [*OMNI, *args],
                cwd=cwd,
                stdout=self._fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=full_env,
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait_output(self, text: str, timeout: float) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            return text in self.output()

        try:
            wait_for(seen, timeout, repr(text))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- log ---\n{self.output()[-3000:]}") from None

    def interrupt_group(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to the whole process group (none, once all of it
        has exited)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def terminate(self) -> None:
        """SIGTERM, once (a second would stop it without draining); `stop` waits for it."""
        if not self._terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 30) -> int:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._fh.close()
        return self.proc.returncode


def stop_together(procs: list[OmniProcess]) -> list[int]:
    """Each process's exit code, all sent SIGTERM first so that they drain side by side, as
    `omni serve` stops its stages (one after another, a deployment's teardown took 4-6 s)."""
    for p in procs:
        p.terminate()
    return [p.stop() for p in procs]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_group_gone(pgid: int, timeout_s: float = 30) -> None:
    """Wait until no process of the group is left; else fail naming the ones that are."""
    try:
        wait_for(lambda: not group_alive(pgid), timeout_s, "every process of the tree to exit")
    except AssertionError as exc:
        left = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if os.getpgid(p.pid) == pgid:
                    command = " ".join(p.info["cmdline"] or [])[:120]
                    left.append(f"{p.info['pid']} {p.info['status']} {command}")
        raise AssertionError(f"{exc}; left: {left}") from None


def openai_client(base: str) -> openai.OpenAI:
    """The official client against a gateway at `base`, which must answer at once: no retries."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def get_json(url: str) -> Any:
    return HTTP.get(url, timeout=5).json()


def start_stage(
    pipeline: Path,
    stage: str,
    replica: str,
    nats_url: str,
    cwd: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> OmniProcess:
    """`omni stage` for one replica; with `wait`, returns once it says it is ready."""
    args = [
        "stage",
        "--pipeline",
        str(pipeline),
        "--stage",
        stage,
        "--replica-id",
        replica,
        "--nats",
        nats_url,
    ]
    p = OmniProcess(
        [*args, "--metrics-host", "127.0.0.1"],
        cwd,
        logs / f"{stage}-{replica}.log",
        env,
    )
    if wait:
        p.wait_output(f"{stage}/{replica} ready", 120)
    return p


def start_gateway(
    pipeline: Path,
    nats_url: str,
    cwd: Path,
    logs: Path,
    name: str = "gateway",
    env: dict[str, str] | None = None,
) -> tuple[OmniProcess, str]:
    """`omni gateway` on a free port; returns the process and its base URL."""
    p = OmniProcess(
        ["gateway", "--pipeline", str(pipeline), "--port", "0", "--host", "127.0.0.1", "--nats", nats_url],
        cwd,
        logs / f"{name}.log",
        env,
    )
    p.wait_output(" on http://127.0.0.1:", 120)
    port = re.search(r" on http://127.0.0.1:(\d+)", p.output()).group(1)  # type: ignore[union-attr]
    return p, f"http://127.0.0.1:{port}"


def replicas(base: str, stage: str) -> list[dict[str, Any]]:
    return [r for r in get_json(f"{base}/replicas")["replicas"] if r["stage"] == stage]


def metric_families(url: str) -> dict[str, Metric]:
    """The metric families a /metrics serves, by name (a counter's without its _total). Not the
    `*_created` ones: prometheus_client's creation times, which the text format lists as
    families of their own."""
    text = HTTP.get(url, timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` a /metrics serves, filtered by labels."""
    text = HTTP.get(url, timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def replica_metric(base: str, stage: str, name: str, replica: str | None = None, **labels: str) -> float:
    """Sum of a metric on a stage's replicas' own /metrics (one replica, or all), filtered by labels."""
    total = 0.0
    for rep in replicas(base, stage):
        if replica is not None and rep["replica"] != replica:
            continue
        total += metric(f"http://127.0.0.1:{rep['metrics_port']}/metrics", name, **labels)
    return total


def read_handles(reader: Any) -> list[Any]:
    """Connector handles a producer process sent down a pipe (as wire frames), until it closed it."""
    from omni_pipeline import wire
    from omni_pipeline.connectors import ConnectorHandle

    handles = []
    while True:
        try:
            handles.append(wire.decode(reader.recv_bytes(), ConnectorHandle))
        except EOFError:
            return handles


def start_serve(
    pipeline: Path,
    cwd: Path,
    log: Path,
    ready_s: float = 180,
    env: dict[str, str] | None = None,
    port: int = 0,
) -> tuple[OmniProcess, str]:
    """`omni serve PIPELINE` once ready, and its base URL; `port`: the one to serve on (0: any free)."""
    serve = OmniProcess(["serve", str(pipeline), "--port", str(port)], cwd, log, env)
    serve.wait_output("ready at", ready_s)
    port = re.search(r"ready at http://127.0.0.1:(\d+)/v1", serve.output()).group(1)  # type: ignore[union-attr]
    return serve, f"http://127.0.0.1:{port}"


def assert_all_gone(serve: OmniProcess, exit_code: int = 0) -> None:
    wait_for(lambda: serve.proc.poll() is not None, 60, "omni serve to exit")
    assert serve.proc.returncode == exit_code, serve.output()[-3000:]
    wait_group_gone(serve.proc.pid)
    prefix = re.search(r"shared memory: /dev/shm/(\S+)-\*", serve.output()).group(1)  # type: ignore[union-attr]
    assert our_shm_segments(f"{prefix}-") == [], "shared-memory segments left behind"


@contextlib.contextmanager
def served(
    pipeline: Path, cwd: Path, log: Path, ready_s: float = 180, env: dict[str, str] | None = None
) -> Iterator[tuple[OmniProcess, str]]:
    """`omni serve PIPELINE` until the block ends; then Ctrl-C, as a terminal sends it, and
    nothing of the tree may be left: no process, no shared-memory segment."""
    serve, base = start_serve(pipeline, cwd, log, ready_s, env)
    try:
        yield serve, base
    finally:
        serve.interrupt_group()
        assert_all_gone(serve)


@contextlib.contextmanager
def served_example(name: str, demo_dir: Path, logs: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """examples/NAME served from the directory holding the demo models; yields its base URL."""
    pipeline = demo_dir / name
    shutil.copy(ROOT / "examples" / name, pipeline)
    with served(pipeline, demo_dir, logs / "serve.log", env=env) as (_, base):
        yield base


def gateway_of(serve: OmniProcess) -> psutil.Process:
    """The serving gateway process of the tree (not one killed and not yet reaped)."""

    def title(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline()).strip() if p.status() != psutil.STATUS_ZOMBIE else ""
        except psutil.Error:  # it exited meanwhile
            return ""

    [gw] = [p for p in psutil.Process(serve.proc.pid).children(recursive=True) if title(p) == "omni: gateway"]
    return gw


def serve_on_port(pipeline: Path, cwd: Path, log: Path, port: int) -> tuple[OmniProcess, openai.OpenAI]:
    """`omni serve PIPELINE` on `port` (a later one serves on the same), and its client."""
    serve, base = start_serve(pipeline, cwd, log, port=port)
    return serve, openai_client(base)


def weights_readable_as_their_configs(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds weight files and each has the mode of the config.json beside it
    (safetensors alone leaves them owner-only, so another user could read the config but not
    the weights)."""
    files = list(checkpoint.rglob("*.safetensors"))
    return bool(files) and all(f.stat().st_mode == (f.parent / "config.json").stat().st_mode for f in files)
