"""step: the host's work in a decode step of the speaking stages, as a share of the step.

On a GPU, what decides a talker's speed is not its matrix work but everything the host does
around it each step, during which the device waits: the engine's bookkeeping, sampling, the
cache handling (the talkers' slot table, engines/slot_cache.py; before it, every request's
cache stacked into one batch and split back each step), and for Qwen3-Omni's code predictor
its loop around its 15 sub-steps a frame. This measures
that share on the real engines (bench.in_process: the example's stage, its own compute thread
and step batcher), for Qwen2.5-Omni's talker, Qwen3-Omni's talker and code predictor, and
Qwen3-TTS's talker: B requests (1 and 8) speak the same thinker reply (Qwen3-TTS: the same
text) together, so their steps run as batches of B.

A step's time is its batched call on the compute thread (StepBatcher.seconds, by kind: `decode`
the talker's next code, `residuals` the code predictor's codes of a frame; Qwen3-TTS's `frame`
both, the talker's step and the code predictor's frame after it); the model's own
forwards in it are timed by forward hooks on the talker's decoder, its codec head and its code
predictor (on a GPU synchronised at each forward's start and end, so a forward's time is its
launches and its device time, and what comes before it is not counted in it). The rest is
host work the device cannot hide: eager steps wait for it, and a step replayed as a CUDA graph
does not remove it. The talkers' decode steps twice: on the slot table's own shapes (`decode`,
`frame`), and at fixed shapes (`decode_fixed`, `frame_fixed`, `fixedSteps: true`: a bucket's
rows over a span of the table's positions, what `cudaGraphs` captures on CUDA; measured uncaptured,
so that the forward hooks still see each forward).

The omni models' thinkers too (`thinker_decode`: B requests thinking together, each on its own
cache, restacked a step; `thinker_decode_fixed`: on the thinker's slot table at fixed shapes,
`fixedSteps`), at the real sizes only with `--thinkers` (a 30B thinker's load and steps).

Ratios: `host_share_<model>_<kind>_b<B>`, the share of a step outside the forwards (lower is
better). Also each step's milliseconds and its forwards'.

`--sizes full --device cuda`: each at its real sizes (Qwen3-TTS: 12Hz-1.7B; config-only
checkpoints with `loadFormat: dummy`: random weights built on the device), for the GPU section of
docs/benchmarks.md; the tiny demo checkpoints otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, parser, report
from bench.in_process import stage_engine
from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import Engine, EngineCall, release_freed_memory
from omni_stage.engines.batching import StepBatcher
from omni_stage.payload import concat

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # model -> (example, demo checkpoint, {kind: the modules whose forwards a step of that kind runs})
    "qwen2.5-omni": ("qwen2.5-omni.yaml", "tiny-qwen2.5-omni", {"decode": ("model",)}),
    "qwen3-omni": (
        "qwen3-omni.yaml",
        "tiny-qwen3-omni",
        {"decode": ("model.model", "model.codec_head"), "residuals": ("model.code_predictor",)},
    ),
    "qwen3-tts": (
        "qwen3-tts.yaml",
        "tiny-qwen3-tts",
        {"frame": ("model.model", "model.codec_head", "model.code_predictor")},
    ),
}
SPOKEN_TEXT = "The sea is calm tonight, and the wind has dropped."  # what Qwen3-TTS's requests say
TTS_RELEASE = "qwen3-tts-1.7b-customvoice"  # --sizes full
FIXED_KINDS = ("decode", "frame")
"""The kinds of step that `fixedSteps` changes (a talker's decode step)."""
THINKING = ("qwen2.5-omni", "qwen3-omni")
"""The models whose thinkers' decode steps are measured too (`thinker_decode`, `thinker_decode_fixed`)."""
THINKER_TOKENS = 24
TALKER_CODES = 48
BATCHES = (1, 8)


class ForwardClock:
    """Seconds spent in one module's forwards, by the batch size of the step they ran in
    (`batch()`: the batcher's call in progress, as its seconds are counted; a forward's own
    rows may be more: a fixed-shape step pads them to a bucket, a table's own step spans the
    slots between its rows), counted for single-position forwards (a decode step's: a talker's
    prefill runs outside its steps) or for all (`steps_only=False`: a code predictor's, whose
    frame starts at two positions)."""

    def __init__(
        self, module: torch.nn.Module, steps_only: bool, sync: Callable[[], None], batch: Callable[[], int]
    ) -> None:
        self.seconds: Counter[int] = Counter()
        self._sync = sync
        self._batch = batch
        self._steps_only = steps_only
        self._started: tuple[float, int] | None = None
        self._hooks = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("inputs_embeds")
        if x is None:
            x = kwargs.get("input_ids", args[0] if args else None)
        if x is None or (self._steps_only and x.shape[1] != 1):
            self._started = None
            return
        self._sync()
        self._started = (time.perf_counter(), self._batch())

    def _post(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._started is not None:
            self._sync()
            t0, batch = self._started
            self.seconds[batch] += time.perf_counter() - t0
            self._started = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def module_at(engine: Engine, path: str) -> torch.nn.Module:
    obj: Any = engine
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def batcher_of(engine: Engine) -> StepBatcher[Any, Any]:
    return next(b for b in vars(engine).values() if isinstance(b, StepBatcher))


async def thought(thinker: Engine, tokens: int, name: str = "thought") -> dict[str, Any]:
    """The thinker's whole reply to one prompt (its outputs joined): what each talker request speaks."""
    request = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me about the sea."}]}]
    }
    sampling = Sampling(max_tokens=tokens, min_tokens=tokens)
    outs = [
        o
        async for o in thinker.generate(
            EngineCall(name, {"request": request | {"media": {}}}, True, sampling)
        )
    ]
    return concat([o.data for o in outs if o.data])


@contextmanager
def clocks(
    engine: Engine, kinds: dict[str, tuple[str, ...]], sync: Callable[[], None]
) -> Iterator[dict[str, list[ForwardClock]]]:
    batcher = batcher_of(engine)
    made = {
        kind: [
            ForwardClock(
                module_at(engine, p), not p.endswith("code_predictor"), sync, lambda: batcher.running
            )
            for p in paths
        ]
        for kind, paths in kinds.items()
    }
    try:
        yield made
    finally:
        for clock in (c for cs in made.values() for c in cs):
            clock.remove()


async def speak_together(talker: Engine, inputs: dict[str, Any], batch: int, codes: int) -> None:
    """`batch` requests speaking from the same `inputs` at once, to their ends."""

    async def one(i: int) -> None:
        call = EngineCall(f"b{batch}-{i}", inputs, True, Sampling(max_tokens=codes))
        async for _ in talker.generate(call):
            pass

    await asyncio.gather(*(one(i) for i in range(batch)))


def timed_steps(
    batcher: StepBatcher[Any, Any],
    kinds: dict[str, list[ForwardClock]],
    batch: int,
    before: tuple[Counter[Any], Counter[Any]],
    label: str,
) -> dict[str, Any]:
    """Each kind's steps of `batch` since `before` (the batcher's seconds and calls then): their
    time, their forwards' (`kinds`' clocks), and the share outside the forwards."""
    seconds, calls = before
    out: dict[str, Any] = {}
    for kind, clock in kinds.items():
        n = batcher.calls[kind, batch] - calls[kind, batch]
        step = batcher.seconds[kind, batch] - seconds[kind, batch]
        forward = sum(c.seconds[batch] for c in clock)
        if n:
            out[f"{label.format(kind=kind)}_b{batch}"] = {
                "steps": n,
                "step_ms": round(step / n * 1000, 3),
                "forward_ms": round(forward / n * 1000, 3),
                "host_share": round(1 - forward / step, 3),
            }
    return out


async def measure_thinker(
    name: str, model: Path, extra: dict[str, Any], tokens: int, fixed: bool
) -> dict[str, Any]:
    """The thinker's decode steps, B requests thinking together: on their own caches (restacked
    a step), or with `fixed` on its slot table at fixed shapes (`fixedSteps`)."""
    example = ROOT / "examples" / MODELS[name][0]
    args = extra | ({"fixedSteps": True, "maxModelLen": 256} if fixed else {})
    thinker = stage_engine(example, "thinker", model, max(BATCHES), **args)
    await thinker.start()
    sync = torch.cuda.synchronize if extra["device"] == "cuda" else (lambda: None)
    batcher = batcher_of(thinker)
    out: dict[str, Any] = {}
    await thought(thinker, 4)  # warm-up: the first forwards' one-off costs
    for batch in BATCHES:
        before = Counter(batcher.seconds), Counter(batcher.calls)
        with clocks(thinker, {"decode": ("model",)}, sync) as clock:
            await asyncio.gather(*(thought(thinker, tokens, f"b{batch}-{i}") for i in range(batch)))
        out |= timed_steps(batcher, clock, batch, before, "thinker_{kind}" + ("_fixed" if fixed else ""))
    await thinker.close()
    return out


async def measure(
    name: str, model: Path, device: str, dtype: str, dummy: bool, codes: int, fixed: bool = False
) -> dict[str, Any]:
    """Each kind's steps at each batch size; with `fixed`, the talker's decode steps only, at
    fixed shapes (as `decode_fixed`)."""
    example, _, kinds = MODELS[name]
    if fixed:
        kinds = {k: v for k, v in kinds.items() if k in FIXED_KINDS}
    extra: dict[str, Any] = {"device": device, "dtype": dtype} | ({"loadFormat": "dummy"} if dummy else {})
    talker_args = extra | ({"fixedSteps": True, "maxModelLen": 512} if fixed else {})
    talker = stage_engine(ROOT / "examples" / example, "talker", model, max(BATCHES), **talker_args)
    await talker.start()
    if name == "qwen3-tts":
        inputs: dict[str, Any] = {"request": {"prompt": SPOKEN_TEXT}}
    else:
        thinker = stage_engine(ROOT / "examples" / example, "thinker", model, 1, **extra)
        await thinker.start()
        inputs = {"thinker": await thought(thinker, THINKER_TOKENS)}
        await thinker.close()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batcher = batcher_of(talker)
    out: dict[str, Any] = {}
    await speak_together(talker, inputs, 1, 4)  # warm-up: the first forwards' one-off costs
    for batch in BATCHES:
        before = Counter(batcher.seconds), Counter(batcher.calls)
        with clocks(talker, kinds, sync) as clock:
            await speak_together(talker, inputs, batch, codes)
        out |= timed_steps(batcher, clock, batch, before, "{kind}" + ("_fixed" if fixed else ""))
    await talker.close()
    return out


async def run(args: Any) -> dict[str, Any]:
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    codes = 12 if args.quick else TALKER_CODES
    models: dict[str, dict[str, Any]] = {}
    if args.sizes == "full":
        from omni_stage.models.qwen2_5_omni import checkpoint as qwen2_5_omni
        from omni_stage.models.qwen3_omni import checkpoint as qwen3_omni
        from omni_stage.models.qwen3_tts import checkpoint as qwen3_tts

        config_only: dict[str, Callable[[Path], Path]] = {
            "qwen3-omni": qwen3_omni.write_config_only,
            "qwen2.5-omni": qwen2_5_omni.write_config_only,
            "qwen3-tts": lambda path: qwen3_tts.write_config_only(path, TTS_RELEASE),
        }
        for name, write in config_only.items():
            model = write(Path(args.model_dir) / name)
            models[name] = await measure(name, model, args.device, dtype, True, codes)
            release_freed_memory()
            models[name] |= await measure(name, model, args.device, dtype, True, codes, fixed=True)
            release_freed_memory()
            if args.thinkers and name in THINKING:
                extra = {"device": args.device, "dtype": dtype, "loadFormat": "dummy"}
                for fixed in (False, True):
                    models[name] |= await measure_thinker(name, model, extra, THINKER_TOKENS, fixed)
                    release_freed_memory()
    else:
        from bench.procs import demo_models  # (not on a GPU machine: it has the core's imports only)

        with demo_models() as demo:
            for name, (_, checkpoint, _) in MODELS.items():
                model = demo / "models" / checkpoint
                models[name] = await measure(name, model, args.device, dtype, False, codes)
                models[name] |= await measure(name, model, args.device, dtype, False, codes, fixed=True)
                if name in THINKING:
                    extra = {"device": args.device, "dtype": dtype}
                    for fixed in (False, True):
                        models[name] |= await measure_thinker(name, model, extra, THINKER_TOKENS, fixed)
    return {
        "benchmark": "step",
        "machine": machine() | ({"gpu": torch.cuda.get_device_name()} if cuda else {}),
        "sizes": args.sizes,
        "talker_codes": codes,
        "models": models,
        "ratios": {
            f"host_share_{name}_{kind}": m["host_share"]
            for name, ms in models.items()
            for kind, m in ms.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--model-dir", default="/tmp/qwen3-omni-full-size", help="--sizes full: where its config goes"
    )
    ap.add_argument(
        "--thinkers", action="store_true", help="--sizes full: the thinkers' steps too (tiny: always)"
    )
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    rows = [
        (
            f"{name} {kind}",
            f"step {m['step_ms']} ms, forwards {m['forward_ms']} ms, host {m['host_share']:.0%}",
        )
        for name, ms in result["models"].items()
        for kind, m in ms.items()
    ]
    report("step", rows, result, args)


if __name__ == "__main__":
    main()
