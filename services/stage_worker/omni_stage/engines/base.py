"""The engine interface: an async stream of outputs per call, cancellable by cancelling the task.

A stage calls its engine once per trigger (see omni_stage.assembly). What an engine carries
between calls of one request (a KV cache, a decoder's left context) is a dataclass of its own,
kept in `call.state` (`call.kept(Kind)`), which the stage owns and drops when the request ends,
however it ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import importlib
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from omni_pipeline.clips import ClipLimits
from omni_pipeline.control import PromptLogprobs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import StageSpec
from omni_pipeline.voices import VoicePrint
from omni_stage.engines.audio_ahead import DEFAULT_SECONDS as AHEAD_SECONDS
from omni_stage.engines.audio_ahead import DEFAULT_STREAMS as AHEAD_STREAMS
from omni_stage.engines.audio_ahead import AudioAhead, WindowEncoder
from omni_stage.engines.batching import StepBatcher
from omni_stage.engines.prompt_cache import DEFAULT_CAPACITY, DEFAULT_IDLE_S, PromptCaches
from omni_stage.payload import Payload
from omni_stage.segments import EngineOutput

T = TypeVar("T")
S = TypeVar("S")


def seeded(seed: int | None) -> torch.Generator:
    """A request's own generator: from its `seed`, else a draw of its own (as vLLM samples an
    unseeded request)."""
    return torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))


class EngineError(RuntimeError):
    """An engine cannot be built or cannot serve a request."""


class InvalidRequest(EngineError):
    """The request asks for what this engine cannot do (a size the model cannot make, a speed
    the vocoder cannot change): the client's error, a 400, not the stage's."""


@dataclass(slots=True)
class CallState:
    """What one request's calls share, for the request's life: the two figures the stage reads
    (its usage and finish) and the engine's own state."""

    prompt_tokens: int = 0
    """The request's prompt as the engine counted it (tokens, or the units it reads)."""
    finish_reason: str | None = None
    """Why the request ended, where its last output does not say (`length`: the budget ran out)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's log probabilities, where the request asked (`prompt_logprobs`)."""
    cached_tokens: int = 0
    """Of `prompt_tokens`, those a kept sequence held, not computed again (`prompt_cache_key`)."""
    engine: object | None = None
    """The engine's own per-request state (`EngineCall.kept`)."""


@dataclass(slots=True)
class EngineCall:
    request_id: str
    inputs: dict[str, Payload]
    """Per producer (or `request` for the client input), the processed payload."""
    is_last: bool
    sampling: Sampling
    state: CallState = field(default_factory=CallState)
    priority: int = 0
    """vLLM's: the lower value first (a batch's lines come after live users' requests)."""

    def kept(self, kind: type[S]) -> S:
        """The engine's own state for this request: `kind()` on its first call, then the same."""
        if self.state.engine is None:
            self.state.engine = kind()
        if not isinstance(self.state.engine, kind):
            raise TypeError(f"request state is a {type(self.state.engine).__name__}, not a {kind.__name__}")
        return self.state.engine


class Engine(ABC):
    """Computes one stage. Heavy work runs off the event loop (threads), so I/O stays live."""

    request_keys: frozenset[str] = frozenset()
    """Sampling fields (`params(...)`) this engine reads when its stage is not a source (a diffusion stage's
    steps and size, a vocoder's speed). A source stage reads them all; others get only these,
    so a talker never takes the client's max_tokens meant for the thinker."""
    accepts: frozenset[str] = frozenset({"text"})
    """The kinds of message content part this engine reads from a client's request (`text`,
    `image`, `audio`, `video`), announced in the replica's heartbeat: a gateway refuses a
    request with any other kind (a 400 naming the part) before anything runs."""
    honours: frozenset[str] = frozenset()
    """The optional Sampling fields (`params(...)`) this engine honours as a source stage (`temperature`,
    `logprobs`, ...; max_tokens every engine does), announced in the replica's heartbeat: a
    gateway refuses a request that sets any other (a 400 naming it) before anything runs."""
    voices: tuple[str, ...] = ()
    """The voices this engine speaks in, its default first (set once it has loaded), announced
    in the replica's heartbeat: a gateway lists them and refuses any other voice (a 400 that
    lists them). Empty: the engine takes no voice."""
    languages: tuple[str, ...] = ()
    """The languages this engine speaks (its names for them), announced in the replica's
    heartbeat: a gateway refuses any other `language` (a 400 that lists them). Empty: it takes
    no language (a request that names one is refused unless the engine honours the field)."""
    needs_last_call: bool = False
    """This engine holds work back until it is told its inputs have ended (a talker still to
    speak past the reply, a vocoder waiting for right context): it is called on the request's
    last trigger even when that brings no inputs (a producer's stream that ended on a window
    boundary sends an empty last chunk). Others are not called for nothing."""

    prompt_caches: PromptCaches | None = None
    """The conversations' sequences kept between requests (`prompt_cache_key`), where the engine
    keeps them (prompt_cache.py); given up on sleep and when a key's session closes."""

    audio_ahead: AudioAhead | None = None
    """Live sessions' audio, encoded as it arrives (audio_ahead.py), where the engine can: its
    requests take the windows encoded ahead. Given up on sleep and when a session closes."""

    clip_limits: ClipLimits | None = None
    """What the engine can make of a video, once loaded (a video denoiser's), announced in the
    replica's heartbeat: a gateway refuses a video job beyond it before queueing it."""

    max_sleep_level: int = 2
    """The deepest sleep this engine can do, in vLLM's levels: 0 frees nothing (the replica only
    stops admitting), 1 moves its weights off the accelerator into host memory, 2 drops them
    (waking loads them again). Announced in the heartbeat, so a gateway refuses a deeper sleep
    before asking for it."""

    def __init__(self, stage: StageSpec) -> None:
        self.stage = stage
        self.args = stage.engine.args

    async def start(self) -> None:
        """Load weights; called once before the replica reports READY."""

    def prompt_tokenizer(self) -> tuple[Any, int] | None:
        """The tokenizer this engine reads a client's prompt with, and the model's context in
        tokens (what /tokenize answers with); None where it reads no text."""
        return None

    async def clone_voice(self, samples: torch.Tensor, rate: int, ref_text: str | None) -> VoicePrint:
        """The voice of a clip (mono float32 `samples` at `rate`), as a request naming it will
        be given it; `ref_text`, its transcript: cloned in context. Engines whose `accepts`
        holds `ref_audio` clone; InvalidRequest for a clip they cannot clone from."""
        raise InvalidRequest(f"{type(self).__name__} clones no voice")

    async def sleep(self, level: int) -> None:
        """Free memory as `level` says (at most `max_sleep_level`); called only while the replica
        holds no request. An engine with nothing to free does nothing."""

    async def wake_up(self, level: int) -> None:
        """Undo `sleep(level)`: the engine computes exactly what it did before."""

    def weight_bytes(self) -> dict[str, int] | None:
        """Bytes of weights the engine holds, per device type (`cpu`, `cuda`); None where it
        cannot tell (vLLM's engine holds them in its own process)."""
        return None

    @abstractmethod
    def generate(self, call: EngineCall) -> AsyncGenerator[EngineOutput, None]:
        """Outputs for one trigger of one request, as they are produced: an async generator,
        which the runner closes when the window ends early (an error, an abort)."""

    def request_ended(self, state: CallState) -> None:
        """A request's end (complete, failed, aborted, past its deadline), between its calls or
        in one: what its own state (`state.engine`) holds beyond itself is given back."""

    def active_requests(self) -> int | None:
        """Requests the engine itself holds, where it tracks them (for the leak gauges)."""
        return None

    def steps_run(self) -> int | None:
        """Loop steps run so far (diffusion steps), where the engine counts them."""
        return None

    def slot_steps(self) -> collections.Counter[str] | None:
        """Decode steps on a slot table so far, by how they ran (engines/fixed_steps.py:
        `replayed` as a CUDA graph, `fixed` at a bucket's shapes launched, `own` at the
        table's own), where the engine steps on one."""
        return None

    def compute_seconds(self) -> float | None:
        """Seconds its forwards have run in all, where it runs them itself (a ComputeEngine)."""
        return None

    def batch_sizes(self) -> collections.Counter[int] | None:
        """How many batched calls of each size it has run, where it batches (a StepBatcher)."""
        return None

    def busy_s(self) -> float | None:
        """How long the oldest work running now (a forward, a prompt's build) has run; None
        while none runs (or where the engine does not tell: vLLM's own engine process is
        watched through `dead`)."""
        return None

    def dead(self) -> str | None:
        """Why this engine can serve nothing more (its engine process died), or None while it
        can. The replica then fails what it holds and exits, to be started afresh."""
        return None

    async def close(self) -> None:
        """Free what `start` took."""

    def voice(self, sampling: Sampling) -> str:
        """The request's voice (its default when it names none); one this engine does not speak
        in is refused, naming those it does."""
        if not self.voices:
            raise EngineError(f"stage '{self.stage.name}': this engine takes no voice")
        name = sampling.voice or self.voices[0]
        if name not in self.voices:
            voices = ", ".join(self.voices)
            raise InvalidRequest(f"voice '{name}' is not one of this model's voices: {voices}")
        return name


class TimedThread(ThreadPoolExecutor):
    """One thread of an engine's (its compute thread, its prompt thread), timing what runs on
    it: how long the work running now has run (the wedge check) and how long it has worked in
    all (the compute thread's busy fraction)."""

    def __init__(self, name: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        self.running_since: float | None = None
        self.busy_seconds = 0.0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(self._timed, fn, args, kwargs)

    def _timed(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        t = self.running_since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.running_since = None
            self.busy_seconds += time.monotonic() - t


LOADING = threading.Lock()
"""Held while an engine of this process loads weights (ComputeEngine._load_alone)."""


class ComputeEngine(Engine):
    """An engine whose forwards all run on one compute thread of its own.

    A replica's requests take turns on the device (a cancelled request's step in progress
    finishes there before the next one starts), so no two forwards race for the cores, and
    the steps that queue while one runs can go as one batched call (`StepBatcher`), up to
    `engine.args.maxBatch` requests (default: the stage's maxInflight; 1: no batching).

    A request's prompt is built on a thread of its own (`_build`): a chat template, its
    tokens, its media's features read no weights, and on the compute thread they would hold
    up every other request's steps (an image's features take as long as a prefill).
    """

    weights: tuple[str, ...] = ()
    """The attributes `_load` sets that hold weights (modules, tensors, or objects holding modules
    with a `to`): what `sleep` moves to host memory (level 1) or drops (level 2; `wake_up` runs
    `_load` again). Every one that holds a module must be named, or a level-2 sleep frees
    nothing of it."""

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.device = torch.device(self.args.get("device", "cpu"))
        self.max_batch = int(self.args.get("maxBatch", stage.max_inflight))
        if self.max_batch < 1:
            raise EngineError(f"stage '{stage.name}': engine.args.maxBatch must be at least 1")
        self._compute = TimedThread(f"{stage.name}-compute")
        self._prompts = TimedThread(f"{stage.name}-prompts")
        if stage.gpu_memory_fraction is not None and torch.cuda.is_available():
            for device in range(torch.cuda.device_count()):  # its own devices: the supervisor placed it
                torch.cuda.set_per_process_memory_fraction(stage.gpu_memory_fraction, device)

    def _kept_conversations(self) -> PromptCaches:
        """The conversations' sequences this engine keeps, bounded by its arguments
        `promptCaches` and `promptCacheIdleS` (prompt_cache.py)."""
        try:
            return PromptCaches(
                int(self.args.get("promptCaches", DEFAULT_CAPACITY)),
                float(self.args.get("promptCacheIdleS", DEFAULT_IDLE_S)),
            )
        except ValueError as exc:
            raise EngineError(f"stage '{self.stage.name}': engine.args.{exc}") from None

    def _audio_ahead(self, encoder: WindowEncoder) -> AudioAhead | None:
        """Live sessions' audio encoded as it arrives with `encoder`, bounded by the engine's
        arguments `audioAheadStreams`, `audioAheadSeconds` and `promptCacheIdleS`; None where
        `audioAhead: false` turns it off."""
        if not self.args.get("audioAhead", True):
            return None
        try:
            return AudioAhead(
                encoder,
                self._run,
                int(self.args.get("audioAheadStreams", AHEAD_STREAMS)),
                float(self.args.get("audioAheadSeconds", AHEAD_SECONDS)),
                float(self.args.get("promptCacheIdleS", DEFAULT_IDLE_S)),
            )
        except ValueError as exc:
            raise EngineError(f"stage '{self.stage.name}': engine.args.{exc}") from None

    def _keep(self, st: Any) -> None:
        """Keep what request state `st` made for its prompt cache key's next request (`st.key`;
        what, if anything: the engines that keep conversations say)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _keeping_if_cut(self, st: Any) -> Iterator[None]:
        """Around the steps of a request (state `st`): cut short (its task cancelled, a
        barge-in; or closed), it calls `_keep(st)` (`_after_compute`), when the request's cache
        is whole again. Until then a request of the same prompt cache key (`st.key` at the cut)
        waits to take it (PromptCaches.cut_mid_step)."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            cut = st.key
            settled = (
                None if cut is None or self.prompt_caches is None else self.prompt_caches.cut_mid_step(cut)
            )
            self._after_compute(lambda: self._keep(st), settled)
            raise

    def _after_compute(self, then: Callable[[], None], settled: Callable[[], None] | None = None) -> None:
        """`then` on the event loop once the compute thread has ended the work in progress (a
        cut request's step), and `settled` after it, however that ends (if the thread was shut
        down, or there is no loop: a generator finalized at exit, `settled` alone). In the
        order asked: a slot given back after its cache was kept. (The batcher hands the thread
        its next batch only after the running one is answered, so this comes right after it.)"""

        def ended(done: asyncio.Future[float]) -> None:
            try:
                if not done.cancelled():
                    then()
            finally:
                if settled is not None:
                    settled()

        try:
            asyncio.get_running_loop().run_in_executor(self._compute, time.monotonic).add_done_callback(ended)
        except RuntimeError:  # no loop, or the compute thread shut down
            if settled is not None:
                settled()

    def _load(self) -> None:
        """Load the weights (on the compute thread): at start, and on waking from level 2."""
        raise NotImplementedError

    async def _load_alone(self, load: Callable[[], None] | None = None) -> None:
        """`load` (default: `_load`) on the compute thread, while no other engine of this
        process loads: transformers' and diffusers' loading builds models on the meta device
        through module-global state, so a load beside another one on another thread leaves
        parameters on meta."""

        def alone() -> None:
            with LOADING:
                (load or self._load)()

        await self._run(alone)

    async def sleep(self, level: int) -> None:
        for held in (self.prompt_caches, self.audio_ahead):
            if held is not None:
                held.clear()
        if level >= 1:  # on the compute thread: no forward is using the weights meanwhile
            await self._run(self._release_weights, level)

    def _release_weights(self, level: int) -> None:
        for name in self.weights:
            held = getattr(self, name)
            setattr(self, name, None if level >= 2 or held is None else held.to("cpu"))
        release_freed_memory()

    async def wake_up(self, level: int) -> None:
        if level >= 2:
            await self._load_alone()
        elif level == 1:
            await self._run(self._restore_weights)

    def _restore_weights(self) -> None:
        for name in self.weights:
            if (held := getattr(self, name)) is not None:  # (a part this model does not have)
                setattr(self, name, held.to(self.device))

    def weight_bytes(self) -> dict[str, int]:
        held: collections.Counter[str] = collections.Counter()
        seen: set[int] = set()  # a tensor two attributes share (a compiled wrapper's) counts once
        for name in self.weights:
            obj = getattr(self, name, None)
            tensors = [obj] if isinstance(obj, torch.Tensor) else []
            if isinstance(obj, torch.nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
            for t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    held[t.device.type] += t.numel() * t.element_size()
        return dict(held)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def _build(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn` on the prompt thread, beside the forwards: a request's host work that reads no
        weights (its tensors may still go to the device). One thread: a burst's builds take
        turns, and the first is ready first."""
        return await asyncio.get_running_loop().run_in_executor(self._prompts, fn, *args)

    def busy_s(self) -> float | None:
        """The compute thread's forward or the prompt thread's build, whichever has run longer
        (a build stuck would keep every request after it from starting)."""
        running = [t for t in (self._compute.running_since, self._prompts.running_since) if t is not None]
        return time.monotonic() - min(running) if running else None

    def compute_seconds(self) -> float:
        return self._compute.busy_seconds

    def batch_sizes(self) -> collections.Counter[int]:
        """Every StepBatcher this engine holds, together."""
        sizes: collections.Counter[int] = collections.Counter()
        for held in vars(self).values():
            if isinstance(held, StepBatcher):
                sizes.update(held.batch_sizes)
        return sizes

    async def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._prompts.shutdown(wait=False, cancel_futures=True)


def release_freed_memory() -> None:
    """Give what dropped weights held back to the system now: torch's CUDA cache to the device,
    and glibc's free heap to the OS (its allocator keeps freed memory for reuse otherwise, so a
    CPU process's resident size would not fall)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None or "libc.so" not in name:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") else None


def import_object(ref: str) -> Callable[..., Any]:
    """`package.module:attribute` -> the attribute, with an error that names the reference."""
    mod_name, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EngineError(f"cannot import {ref!r}: {exc}") from exc
