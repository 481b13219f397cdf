"""A pipeline deployed as separate `omni` processes (one per replica, one per gateway), as pods
are: each started, killed and stopped on its own, against a real nats-server."""

from __future__ import annotations

import base64
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import (
    HTTP,
    SHM_SESSION,
    OmniProcess,
    decode_wav,
    get_json,
    start_gateway,
    start_stage,
    stop_together,
    wait_for,
)

STREAMED: Final = "a streamed one"
"""What SteadyLoad's streaming workers ask, every time."""
HELD: Final = (
    "omni_gateway_tracked_requests",
    "omni_stage_tracked_requests",
    "omni_asyncio_tasks",
    "omni_nats_subscriptions",
    "omni_shm_segments",
    "omni_mooncake_keys",
)
"""What a process holds per request; each returns to its idle value when requests end."""


def metric_values(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = HTTP.get(url, timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def metrics_urls(gateways: list[str]) -> dict[str, str]:
    """Every process's /metrics behind these gateway base URLs: each gateway's, and each live
    replica's (from the first gateway's replica table)."""
    urls = {f"gateway-{i}": f"{base}/metrics" for i, base in enumerate(gateways)}
    for r in get_json(f"{gateways[0]}/replicas")["replicas"]:
        urls[f"{r['stage']}-{r['replica']}"] = f"http://127.0.0.1:{r['metrics_port']}/metrics"
    return urls


def gauges(gateways: list[str], names: tuple[str, ...] = HELD) -> dict[str, dict[str, float]]:
    """process -> {gauge: value} for the gauges named, each summed over its labels."""
    return {proc: metric_values(url, names) for proc, url in metrics_urls(gateways).items()}


def settle(gateways: list[str], idle: dict[str, dict[str, float]], timeout: float = 30) -> None:
    """Wait until every process holds what it held when `idle` was read."""
    try:
        wait_for(lambda: gauges(gateways) == idle, timeout, "every process to let go")
    except AssertionError:
        now = gauges(gateways)
        diff = {
            p: {k: (v, now.get(p, {}).get(k)) for k, v in g.items() if now.get(p, {}).get(k) != v}
            for p, g in idle.items()
        }
        # Which segments, by name (request, reader, owner): what a leak's cause is read from.
        segments = sorted(p.name for p in Path("/dev/shm").glob(f"{SHM_SESSION}*") if "-@free-" not in p.name)
        raise AssertionError(f"still held after {timeout}s, (idle, now): {diff}; shm: {segments}") from None


@dataclass
class Deployment:
    pipeline: Path
    nats_url: str
    cwd: Path
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    stages: dict[str, OmniProcess] = field(default_factory=dict)
    gateways: list[tuple[OmniProcess, str]] = field(default_factory=list)

    @property
    def base(self) -> str:
        """The first gateway's base URL."""
        return self.gateways[0][1]

    @property
    def bases(self) -> list[str]:
        return [base for _, base in self.gateways]

    def rss(self) -> dict[str, float]:
        """process -> resident memory in bytes, from each process's own /metrics."""
        name = "process_resident_memory_bytes"
        return {proc: metric_values(url, (name,))[name] for proc, url in metrics_urls(self.bases).items()}

    def gauges(self, names: tuple[str, ...] = HELD) -> dict[str, dict[str, float]]:
        return gauges(self.bases, names)

    def settle(self, idle: dict[str, dict[str, float]], timeout: float = 30) -> None:
        settle(self.bases, idle, timeout)

    def add_stage(self, stage: str, replica: str, wait: bool = False) -> OmniProcess:
        p = start_stage(
            self.pipeline, stage, replica, self.nats_url, self.cwd, self.logs, self.env, wait=wait
        )
        self.stages[f"{stage}-{replica}"] = p
        return p

    def add_gateway(self) -> str:
        gw = start_gateway(
            self.pipeline,
            self.nats_url,
            self.cwd,
            self.logs,
            name=f"gateway-{len(self.gateways)}",
            env=self.env,
        )
        self.gateways.append(gw)
        return gw[1]

    def stop(self) -> None:
        """Stop every process; each must exit 0, unless the test itself killed it."""
        procs = [(f"gateway-{i}", g[0]) for i, g in enumerate(self.gateways)] + list(self.stages.items())
        killed = {name for name, p in procs if p.proc.poll() == -signal.SIGKILL}
        codes = dict(zip((name for name, _ in procs), stop_together([p for _, p in procs]), strict=True))
        failed = [name for name, c in codes.items() if c != 0 and name not in killed]
        assert not failed, f"{codes}\n{self.log_tails(*failed)}"

    def log_tails(self, *names: str, lines: int = 25) -> str:
        """The last lines of these processes' logs (every log in the directory without names):
        what a failure message carries, since CI keeps only the test's output."""
        paths = sorted(self.logs.glob("*.log"))
        if names:
            paths = [p for p in paths if p.stem.split("~")[0] in names]
        return "\n".join(
            f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in paths
        )


@contextlib.contextmanager
def deployed(
    pipeline: Path,
    layout: dict[str, int],
    gateways: int,
    nats_url: str,
    cwd: Path,
    logs: Path,
    env: dict[str, str] | None = None,
) -> Iterator[Deployment]:
    """`layout`: replicas per stage (named a, b, ...); yields once every gateway is ready, and
    stops every process when the block ends, however it ends."""
    d = Deployment(pipeline, nats_url, cwd, logs, env or {})
    try:
        for stage, n in layout.items():
            for i in range(n):
                d.add_stage(stage, chr(ord("a") + i))
        for _ in range(gateways):
            base = d.add_gateway()
            wait_for(lambda b=base: HTTP.get(f"{b}/health").status_code == 200, 120, "every stage registered")
        yield d
    finally:
        d.stop()


def ask(base: str, content: str, timeout: float = 90, **extra: object) -> str:
    """One text+audio request; returns 'ok' or the error message."""
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout, http_client=HTTP
    )
    try:
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": content}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            **extra,  # type: ignore[arg-type]
        )
    except openai.APIError as exc:
        return f"error: {exc}"
    samples, _ = decode_wav(r.choices[0].message.audio.data)
    return "ok" if r.choices[0].message.content and len(samples) > 0 else "empty"


@dataclass(frozen=True)
class Streamed:
    """What one streamed text+audio request gave its client: the text, the audio (PCM16
    samples), and the error event that ended it, if one did."""

    text: str
    samples: int
    error: str | None = None


def ask_streaming(base: str, content: str, timeout: float = 90, **extra: object) -> Streamed:
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout, http_client=HTTP
    )
    text, pcm = [], 0
    try:
        for chunk in client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": content}],
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            stream=True,
            **extra,  # type: ignore[arg-type]
        ):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text.append(delta.content or "")
            audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
            if audio:
                data = audio["data"] if isinstance(audio, dict) else audio.data
                pcm += len(base64.b64decode(data or "")) // 2
    except openai.APIError as exc:
        return Streamed("".join(text), pcm, str(exc))
    return Streamed("".join(text), pcm)


class SteadyLoad:
    """`workers` threads sending one request after another until the block ends; every answer
    is kept, in order. Leaving the block waits for each thread's last request: none may hang."""

    def __init__(self, base: str, workers: int = 3, timeout: float = 90, streams: int = 0) -> None:
        self.base = base
        self.timeout = timeout
        self.results: list[str] = []
        self.spans: list[tuple[float, float, str]] = []
        """(start, end, result) of each request, on time.monotonic()."""
        self.streamed: list[Streamed] = []
        """What each of the `streams` workers' streamed requests gave its client."""
        self._running: dict[tuple[str, int, int], float] = {}
        """The requests in flight: (kind, worker, number) -> start."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,)) for w in range(workers)]
        self._threads += [threading.Thread(target=self._stream, args=(w,)) for w in range(streams)]

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            t0 = self._running["ask", worker, i] = time.monotonic()
            result = ask(self.base, f"steady {worker}-{i}", timeout=self.timeout)
            self.spans.append((t0, time.monotonic(), result))
            self.results.append(result)
            del self._running["ask", worker, i]
            i += 1

    def _stream(self, worker: int) -> None:
        """The same request every time: its undisturbed answer is known (`ask_streaming`)."""
        i = 0
        while not self._stop.is_set():
            self._running["stream", worker, i] = time.monotonic()
            self.streamed.append(ask_streaming(self.base, STREAMED, timeout=self.timeout))
            del self._running["stream", worker, i]
            i += 1

    def in_flight(self) -> set[tuple[str, int, int]]:
        """The requests in flight now, whole and streamed."""
        return set(self._running.copy())  # (a copy is atomic under the GIL: the workers add and remove)

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def flowing(self, n: int = 3, timeout: float = 60) -> None:
        """Wait until `n` more requests have ended."""
        have = len(self.results)
        wait_for(lambda: len(self.results) >= have + n, timeout, f"{n} more requests to end")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 30)
        assert not any(t.is_alive() for t in self._threads), "a request never ended"

    def failures(self) -> list[str]:
        return [r for r in self.results if r != "ok"]
