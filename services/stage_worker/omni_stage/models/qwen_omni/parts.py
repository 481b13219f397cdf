"""What every Qwen-Omni part shares: loading its piece of one checkpoint, its voices, the talkers'
repetition penalty, the thinker's embedding table read alone."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from omni_pipeline.payloads import gather
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import ComputeEngine, EngineError
from omni_stage.models.qwen_omni.audio_windows import AudioWindows
from omni_stage.models.qwen_omni.prompt import Prompts

DEFAULT_VOICE: Final = "Chelsie"
REPETITION_PENALTY: Final = 1.05  # Qwen2_5OmniForConditionalGeneration.generate's talker default
TALKER_MAX_CODES: Final = 4096  # its talker_max_new_tokens
_DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOAD_FORMATS: Final = ("auto", "dummy")
"""`loadFormat`, vLLM's `load_format`: `auto` reads the checkpoint's weights; `dummy` builds each
part at its config's sizes with random weights on the device and reads none (a real-sized
pipeline measured where its weights cannot be fetched or do not fit the disk)."""
DUMMY_RANGE: Final = 1e-3
"""Dummy weights are drawn uniformly from +-this, as vLLM's dummy loader draws them."""


class SeenCodes:
    """The codes each slot's request has seen, for the repetition penalty the references'
    generate applies to a talker's codes: a bool row a slot of the talker's table, on its
    device, so that a batch's pick is a few tensor ops however many codes its requests have
    made (transformers' processor takes each row's codes as a list, rebuilt every step)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.rows = torch.zeros(0, vocab, dtype=torch.bool, device=device)

    def start(self, slot: int, codes: Iterable[int] = ()) -> None:
        """A request's first pick at `slot` comes next: it has seen `codes` (its prompt's)."""
        if slot >= self.rows.shape[0]:
            grown = self.rows.new_zeros(max(slot + 1, 2 * self.rows.shape[0]), self.rows.shape[1])
            grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[slot] = False
        if ids := list(codes):
            self.rows[slot, torch.tensor(ids, device=self.rows.device)] = True

    def greedy(self, logits: torch.Tensor, slots: list[int], never: torch.Tensor) -> list[int]:
        """Each row's greedy code ([B, vocab] float logits, row i slot i's), as the references'
        generate picks it: the repetition penalty over the codes its slot has seen (as
        transformers' processor computes it, once a code), the codes `never` ([vocab] or [B,
        vocab] bool: control codes, an eos too early) masked out. The codes picked are seen
        from then on (a talker feeds each back before its next pick)."""
        at = torch.tensor(slots, device=self.rows.device)
        penalised = torch.where(logits < 0, logits * REPETITION_PENALTY, logits / REPETITION_PENALTY)
        picked = torch.where(self.rows[at], penalised, logits).masked_fill(never, -float("inf")).argmax(-1)
        self.rows[at, picked] = True
        return picked.tolist()  # type: ignore[no-any-return]


def code_mask(vocab: int, codes: Iterable[int], device: torch.device) -> torch.Tensor:
    """[vocab] bool: True at `codes` (SeenCodes.greedy's `never`)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[list(codes)] = True
    return mask


def dummy_model(cls: Any, config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' `cls` at `config`'s sizes, built on `device` with dummy weights (LOAD_FORMATS),
    seeded: every run of a pipeline computes the same."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return dummy_weights(model, device)


def dummy_weights(model: torch.nn.Module, device: torch.device) -> Any:
    """`model` (on `device`) with every floating-point weight drawn uniformly from +-DUMMY_RANGE,
    seeded: every run of a pipeline computes the same."""
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
    return model.eval()


def thinker_embedding_table(stage: str, path: str) -> torch.Tensor:
    """The thinker's input embedding table, read alone from the checkpoint's safetensors."""
    from safetensors import safe_open

    name = "thinker.model.embed_tokens.weight"
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return sf.get_tensor(name)
    raise EngineError(f"stage '{stage}': {path} has no {name}")


@dataclass(slots=True)
class Vocoding:
    """A vocoder part's request: the codes received so far, and how many are decoded."""

    codes: torch.Tensor | None = None
    decoded: int = 0
    context: int = 0
    """The first codes that are the decoder's context alone (payloads.Codes.context)."""

    def gather(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """Every code received so far, these inputs' included; None before the first."""
        self.context = max([self.context, *gather(inputs, "context")])
        new = [c.long() for c in gather(inputs, "codes") if c.numel()]
        if new:
            self.codes = torch.cat(new if self.codes is None else [self.codes, *new])
        return self.codes


def _one_voice(speaker: dict[str, Any]) -> dict[str, Any]:
    """A voice's conditioning without the batch of one the speaker file holds it in (`cond`
    [1, dim], `ref_mel` [1, frames, mel]), as transformers' generate expands it."""
    out = dict(speaker)
    if isinstance(cond := out.get("cond"), torch.Tensor) and cond.dim() == 2:
        out["cond"] = cond[0]
    if isinstance(ref := out.get("ref_mel"), torch.Tensor) and ref.dim() == 3:
        out["ref_mel"] = ref[0]
    return out


def chunk_args(stage: StageSpec, chunk: int, left: int, right: int, least_chunk: int) -> tuple[int, int, int]:
    """A vocoder part's `chunkCodes`, `leftContextCodes`, `rightContextCodes` (these defaults),
    checked: codes per chunk, and the context decoded with each on either side."""
    args = stage.engine.args
    got = int(args.get("chunkCodes", chunk)), int(args.get("leftContextCodes", left))
    c, lc, rc = (*got, int(args.get("rightContextCodes", right)))
    if c < least_chunk or lc < 0 or rc < 0:
        raise EngineError(
            f"stage '{stage.name}': chunkCodes must be at least {least_chunk}, "
            "left/rightContextCodes at least 0"
        )
    return c, lc, rc


@dataclass(frozen=True, slots=True)
class FirstChunk:
    """How many codes a code2wav's first piece decodes, by the replica's load: `firstChunkCodes`
    on an idle replica (the decoder's fewest by default), more as its compute fills, up to
    `busyFirstChunkCodes` (its longest chunk by default) once a whole call's worth waits. Each
    piece is a decoder call of its own: under load the extra calls cost throughput; idle,
    nothing."""

    least: int
    most: int
    step: int = 1
    """The first piece's codes are a multiple of this (a DiT's block, in codes)."""

    @classmethod
    def of(
        cls, stage: StageSpec, smallest: int, largest: int, largest_name: str = "chunkCodes", step: int = 1
    ) -> FirstChunk:
        """The stage's bounds, checked: `smallest` (the decoder's fewest) <= firstChunkCodes <=
        busyFirstChunkCodes <= `largest` (its longest chunk, the `largest_name` setting), each
        a multiple of `step`."""
        least = int(stage.engine.args.get("firstChunkCodes", smallest))
        most = int(stage.engine.args.get("busyFirstChunkCodes", largest))
        if not smallest <= least <= most <= largest:
            raise EngineError(
                f"stage '{stage.name}': need {smallest} <= firstChunkCodes ({least}) "
                f"<= busyFirstChunkCodes ({most}) <= {largest_name} ({largest})"
            )
        for name, n in (("firstChunkCodes", least), ("busyFirstChunkCodes", most)):
            if n % step:
                raise EngineError(f"stage '{stage.name}': {name} must be a multiple of {step}")
        return cls(least, most, step)

    def codes(self, occupancy: float) -> int:
        """The first piece's codes for a request starting now, its replica's batcher this full
        (down to a multiple of `step`)."""
        n = self.least + round((self.most - self.least) * min(1.0, occupancy))
        return n - n % self.step


COMPILE_MODES: Final = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes: `reduce-overhead` replays CUDA graphs on a GPU (inductor alone on a CPU)."""


GRAPH_MODES: Final = ("reduce-overhead", "max-autotune")
"""The modes that replay CUDA graphs."""


def compiles(stage: StageSpec) -> bool:
    """Whether a part's `compile` argument asks for `torch.compile` (anything but false or
    absent): then the part also runs what requests run at start (its warm-up), to compile it."""
    return stage.engine.args.get("compile") not in (False, None)


def compiler(stage: StageSpec, graphs: bool = True) -> Callable[[Any], Any]:
    """A part's `compile` argument as what wraps a module: nothing (false, the default),
    `torch.compile` with dynamic shapes (true), or in one of its modes (a mode's name).
    `graphs=False`: the part's modules see a KV cache that grows at each step, and a CUDA
    graph is recorded for fixed shapes (one per length: no saving), so the modes that replay
    them are refused."""
    if not compiles(stage):
        return lambda module: module
    asked = stage.engine.args["compile"]
    modes = COMPILE_MODES if graphs else tuple(m for m in COMPILE_MODES if m not in GRAPH_MODES)
    if asked is not True and asked not in modes:
        why = "" if graphs or asked not in GRAPH_MODES else " (its KV cache grows each step: no CUDA graphs)"
        raise EngineError(
            f"stage '{stage.name}': compile must be true, false or one of {', '.join(modes)}; "
            f"got {asked!r}{why}"
        )
    mode = None if asked is True else str(asked)
    if mode in GRAPH_MODES:
        return lambda module: StepPerCall(torch.compile(module, dynamic=True, mode=mode))
    return lambda module: torch.compile(module, dynamic=True, mode=mode)


class StepPerCall(torch.nn.Module):
    """A module compiled to replay CUDA graphs, each call a step of its own whose output is a
    copy: a graph's outputs are overwritten when it replays, and the vocoders call one layer
    several times a chunk (the DiT's four evaluations a solver step) and keep what it gave."""

    def __init__(self, compiled: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(*args, **kwargs)
        return out.clone() if isinstance(out, torch.Tensor) else out


class Part(ComputeEngine):
    """Loading one part of the checkpoint, and the voices."""

    part: str
    weights: tuple[str, ...] = ("model",)
    config_class = "Qwen2_5OmniConfig"
    model_name = "Qwen2.5-Omni"

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.dtype = _DTYPES[self.args.get("dtype", "float32")]
        self.load_format = str(self.args.get("loadFormat", "auto"))
        if self.load_format not in LOAD_FORMATS:
            raise EngineError(
                f"stage '{stage.name}': engine.args.loadFormat must be one of {', '.join(LOAD_FORMATS)}; "
                f"got {self.load_format!r}"
            )
        self.path = str(stage.engine.model)
        self.model: Any = None
        self.config: Any = None
        self.speakers: dict[str, dict[str, Any]] = {}
        """Each voice's conditioning, from the checkpoint's speaker file."""

    async def start(self) -> None:
        await self._load_alone()

    def _load(self) -> None:
        self._read_config()
        cls, sub = self._part_class()
        self.model = self._from_checkpoint(cls, sub, f"^{self.part}\\.")
        spk = Path(self.path, "spk_dict.pt")
        if spk.exists() and self.part != "thinker":  # a file of the checkpoint, loaded as transformers does
            self.speakers = {name: _one_voice(v) for name, v in torch.load(spk, weights_only=True).items()}
            self.voices = tuple(sorted(self.speakers, key=lambda name: name != DEFAULT_VOICE))

    def _read_config(self) -> None:
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()  # the load report lists the other parts' weights
        self._set_threads()
        if not Path(self.path).is_dir():
            raise EngineError(f"stage '{self.stage.name}': model directory {self.path!r} not found")
        try:
            self.config = getattr(transformers, self.config_class).from_pretrained(self.path)
        except (OSError, ValueError) as exc:
            raise EngineError(
                f"stage '{self.stage.name}': {self.path} is not a {self.model_name} checkpoint: {exc}"
            ) from exc

    def _set_threads(self) -> None:
        """`threads`: torch's threads in this stage's process (its own default: every core)."""
        if threads := self.args.get("threads"):
            torch.set_num_threads(int(threads))

    def _from_checkpoint(self, cls: Any, config: Any, prefix: str) -> Any:
        """Transformers' class `cls` with the checkpoint's weights under `prefix` (a regex)."""
        if self.load_format == "dummy":
            return dummy_model(cls, config, self.device, self.dtype)
        return (
            cls.from_pretrained(self.path, config=config, key_mapping={prefix: ""}, dtype=self.dtype)
            .to(self.device)
            .eval()
        )

    def _part_class(self) -> tuple[Any, Any]:
        """The transformers class of this part and its sub-config (a part loaded whole)."""
        raise NotImplementedError

    def _thinker_embeddings(self) -> torch.Tensor:
        """The thinker's input embedding table on this part's device (a talker reads the TTS
        tokens' rows of it): read alone from the checkpoint, or dummy weights of its size."""
        if self.load_format == "dummy":
            text = self.config.thinker_config.text_config
            gen = torch.Generator(self.device).manual_seed(1)
            table = torch.empty(text.vocab_size, text.hidden_size, device=self.device, dtype=self.dtype)
            return table.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
        return thinker_embedding_table(self.stage.name, self.path).to(self.device, self.dtype)

    def _hear_ahead(self, prompts: Prompts, tower: Callable[[], Any]) -> None:
        """(At each load.) Live sessions' audio encoded as it arrives by the audio tower
        `tower` returns (audio_windows.py), where this part hears: the same sessions across a
        sleep's wake, the newly loaded tower's windows."""
        if "audio" not in self.accepts:
            return
        windows = AudioWindows(prompts, tower, self.config.thinker_config.audio_config)
        if self.audio_ahead is None:
            self.audio_ahead = self._audio_ahead(windows)
        else:
            self.audio_ahead.encoder = windows

    def speaker(self, sampling: Sampling) -> dict[str, Any]:
        """The conditioning of the request's voice."""
        if not self.voices:
            raise EngineError(f"stage '{self.stage.name}': {self.path} has no speaker file (spk_dict.pt)")
        return self.speakers[self.voice(sampling)]
