"""The pipeline spec: one model for the `omni serve` file and the OmniPipeline CR's `spec`.

Field names are camelCase on the wire (as Kubernetes expects) and snake_case in Python.
Everything a bad file can get wrong is refused here, before any process starts, with the
stage and field named, so a user never debugs a half-started pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from omni_pipeline.placement import place
from omni_pipeline.sampling import Sampling
from omni_pipeline.settings import (
    ConnectorSpec,
    GatewaySpec,
    MooncakeSpec,
    NatsSpec,
    ObservabilitySpec,
    PodsSpec,
)
from omni_pipeline.settings import SpecModel as _Model

REQUEST_SOURCE: Final = "request"
"""The pseudo-stage an input edge names to read the client's request."""

FULL_WINDOW: Final = -1
"""Window size meaning: trigger the consumer once, when the producer's last segment arrives."""

DEFAULT_CONNECTOR: Final = "default"

DEFAULT_CREDIT: Final = 16
"""Chunks a producer may have unread by its consumer, per request and edge, unless the edge says."""
MAX_CREDIT: Final = 1024


class SpecError(ValueError):
    """A pipeline file that cannot run; the message names the stage and the field."""


class Mode(StrEnum):
    SINGLE_NODE = "SingleNode"
    DISTRIBUTED = "Distributed"


class EngineKind(StrEnum):
    SYNTHETIC = "synthetic"
    TRANSFORMERS = "transformers"
    TORCH = "torch"
    VLLM = "vllm"
    DIFFUSERS = "diffusers"


class OutputKind(StrEnum):
    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"


class EngineSpec(_Model):
    """What computes a stage: the engine kind and what it loads."""

    kind: EngineKind = Field(description="Engine backend: synthetic, transformers, torch, vllm, diffusers.")
    model: str | None = Field(default=None, description="Model directory or id, for model engines.")
    factory: str | None = Field(
        default=None, description="`module:function` returning a torch module, for the torch engine."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Engine-specific arguments.")

    @model_validator(mode="after")
    def _needs(self) -> EngineSpec:
        if self.kind in (EngineKind.TRANSFORMERS, EngineKind.VLLM, EngineKind.DIFFUSERS) and not self.model:
            raise ValueError(f"engine kind '{self.kind}' needs engine.model")
        if self.kind is EngineKind.TORCH and (not self.factory or ":" not in self.factory):
            raise ValueError("engine kind 'torch' needs engine.factory as 'module:function'")
        return self


class InputSpec(_Model):
    """One in-edge of a stage: where it reads from, how often it is triggered, and over what."""

    from_: str = Field(
        alias="from", max_length=63, description="Producer stage name, or `request` for the client input."
    )
    window: int = Field(
        default=FULL_WINDOW,
        description="-1: trigger once at the producer's end; N > 0: every N units, then the remainder.",
    )
    first_window: int | None = Field(
        default=None,
        ge=1,
        description="The first chunk of each request's stream: this many units, sooner than `window` "
        "(a decoder's first audio after its fewest codes); then every `window`. Default: `window`.",
    )
    processor: str | None = Field(
        default=None, description="`module:function` run on the consumer to turn the payload into inputs."
    )
    connector: str = Field(default=DEFAULT_CONNECTOR, description="Name of an entry in spec.connectors.")
    media: bool = Field(
        default=True,
        description="On a `request` edge: false sends this stage the messages without their decoded media "
        "(it reads an encoder stage's outputs instead, so the media cross the connector once).",
    )
    credit: int = Field(
        default=DEFAULT_CREDIT,
        ge=1,
        le=MAX_CREDIT,
        description=(
            "Chunks the producer may have put for one request and this stage not yet read; past it the "
            "producer pauses that request until a read returns credit (backpressure)."
        ),
    )

    @field_validator("window")
    @classmethod
    def _window(cls, v: int) -> int:
        if v == 0 or v < FULL_WINDOW:
            raise ValueError(f"window must be -1 (full) or a positive number of units, got {v}")
        return v

    @model_validator(mode="after")
    def _first_window(self) -> InputSpec:
        if self.first_window is not None and not 0 < self.first_window <= self.window:
            raise ValueError(
                f"firstWindow ({self.first_window}) must be at most window ({self.window}), "
                "on a windowed edge"
            )
        return self

    @field_validator("processor")
    @classmethod
    def _processor(cls, v: str | None) -> str | None:
        if v is not None and ":" not in v:
            raise ValueError(f"processor must be 'module:function', got {v!r}")
        return v


class ResourcesSpec(_Model):
    gpus: int = Field(default=0, ge=0, description="GPUs per replica.")
    cpu: str | None = Field(default=None, description="CPU request, Kubernetes quantity.")
    memory: str | None = Field(default=None, description="Memory request, Kubernetes quantity.")


class KedaSpec(_Model):
    """Scale with KEDA on a Prometheus query instead of an HPA on the custom metrics API."""

    prometheus_address: str = Field(
        pattern=r"^https?://\S+$",
        description="The Prometheus KEDA queries, e.g. http://prometheus-operated.monitoring:9090.",
    )
    query: str | None = Field(
        default=None,
        description="PromQL for the stage's load, compared with targetAverageValue per replica. Default: "
        "the sum of `metric` over the stage's pods, by the labels the chart's PodMonitor adds.",
    )
    polling_interval_s: int = Field(
        default=15, ge=1, alias="pollingIntervalSeconds", description="How often KEDA queries."
    )


class AutoscalingSpec(_Model):
    """Scale a stage on its queue (an HPA on the per-pod metric, or KEDA); the operator then
    leaves replicas to the autoscaler."""

    min_replicas: int = Field(default=1, ge=0, description="Fewest replicas (0 only with KEDA).")
    max_replicas: int = Field(ge=1, description="Most replicas.")
    metric: str = Field(
        default="omni_stage_queued_requests", description="Per-pod metric to scale on (custom metrics API)."
    )
    target_average_value: str = Field(default="4", description="Target average of the metric per pod.")
    keda: KedaSpec | None = Field(
        default=None, description="Set: a KEDA ScaledObject on Prometheus does the scaling, not an HPA."
    )

    @model_validator(mode="after")
    def _range(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas: {self.min_replicas} is more than maxReplicas {self.max_replicas}")
        if self.min_replicas == 0 and self.keda is None:
            raise ValueError("minReplicas: 0 needs keda (an HPA scales no lower than 1)")
        return self


class StageSpec(_Model):
    """One stage of the pipeline: an engine, its in-edges, and how many replicas serve it."""

    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$", max_length=40, description="DNS-label stage name."
    )
    engine: EngineSpec
    inputs: list[InputSpec] = Field(min_length=1, max_length=16, description="In-edges of this stage.")
    final_output: OutputKind | None = Field(
        default=None,
        description="If set, this stage's output goes to the client as text, audio, image or video.",
    )
    skip_without_media: bool = Field(
        default=False,
        description="Run this stage only for requests with media parts (an encoder stage): a request "
        "without them skips it, and its consumers go on with their other inputs.",
    )
    replicas: int = Field(default=1, ge=0, description="Replicas of this stage.")
    max_inflight: int = Field(default=1, ge=1, description="Concurrent requests in one replica (1 = serial).")
    max_queued: int = Field(default=64, ge=0, description="Requests a replica queues beyond max_inflight.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="What one replica needs.")
    devices: str | None = Field(
        default=None,
        pattern=r"^\d+(,\d+)*$",
        description="SingleNode: the pod's GPUs (indices, comma-separated) this stage's replicas run on, "
        "resources.gpus each in replica order, as vLLM-Omni's `devices`; unset: packed in file order.",
    )
    share_device: bool = Field(
        default=False,
        description="SingleNode: this stage may share its devices with other stages that say so.",
    )
    gpu_memory_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="The share of each of its GPUs' memory one replica may take (vLLM's "
        "gpu_memory_utilization; torch engines cap their allocator); required on a shared device, at most 1 "
        "in all there.",
    )
    nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="The niceness its processes run at (os.nice): where stages share a host's cores "
        "(SingleNode on CPU), a stage that runs far ahead of the ones after it (a thinker) gives them the "
        "cores first when they compete.",
    )
    sampling: dict[str, Any] = Field(default_factory=dict, description="Default sampling parameters.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector (Kubernetes).")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Pod tolerations (Kubernetes)."
    )
    affinity: dict[str, Any] = Field(default_factory=dict, description="Pod affinity (Kubernetes).")
    autoscaling: AutoscalingSpec | None = Field(default=None, description="Scale this stage with an HPA.")
    max_unread_bytes: int = Field(
        default=1 << 30,
        ge=1,
        description=(
            "Bytes of this replica's output put on connectors and not yet read by its consumers; at this "
            "mark it admits no new request (answers full) until they catch up."
        ),
    )
    max_segment_units: int = Field(default=16, ge=1, description="Flush a segment after this many units.")
    flush_interval_ms: float = Field(default=50.0, gt=0, description="Flush a segment after this long.")
    step_timeout_s: float | None = Field(
        default=None,
        gt=0,
        alias="stepTimeoutSeconds",
        description="A forward of this stage's engine running longer than this means the replica is wedged: "
        "it fails what it holds (gateways run those requests elsewhere) and exits, to be restarted. "
        "Unset: no limit (vLLM engines: their engine process's death is watched instead).",
    )
    paused: bool = Field(
        default=False,
        description="Put this stage's replicas to sleep (they finish what they hold, then free their "
        "engine's memory as deeply as it can: POST /v1/omni/sleep's level 2) until set false again. Running "
        "replicas follow it without a restart; new ones start asleep.",
    )

    @field_validator("sampling")
    @classmethod
    def _sampling_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        Sampling.of(v)  # a misspelt or mistyped default fails here, not as a silent None later
        return v


class PipelineSpec(_Model):
    """The whole pipeline: stages forming a DAG, connectors, control plane and gateway."""

    mode: Mode = Field(
        default=Mode.SINGLE_NODE,
        description="SingleNode: one process tree (one pod); Distributed: a pod per replica.",
    )
    served_model_name: str = Field(min_length=1, description="The model name clients ask for.")
    image: str | None = Field(
        default=None, description="Container image of every pod (default: the operator's)."
    )
    nats: NatsSpec = Field(default_factory=NatsSpec, description="The control plane.")
    connectors: dict[str, ConnectorSpec] = Field(
        default_factory=lambda: {DEFAULT_CONNECTOR: ConnectorSpec()},
        description="Data-plane connectors by name; an edge picks one in inputs[].connector.",
    )
    mooncake: MooncakeSpec | None = Field(
        default=None, description="The Mooncake store, for mooncake connectors."
    )
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The OpenAI-compatible gateway.")
    pods: PodsSpec = Field(default_factory=PodsSpec, description="Extra env and volumes for every pod.")
    observability: ObservabilitySpec = Field(
        default_factory=ObservabilitySpec, description="Where traces go (docs/observability.md)."
    )
    stages: list[StageSpec] = Field(min_length=1, max_length=64, description="The stages; they form a DAG.")

    @model_validator(mode="after")
    def _graph(self) -> PipelineSpec:
        names = [s.name for s in self.stages]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise ValueError(f"stage '{n}': name: duplicate stage name")
            seen.add(n)
        if REQUEST_SOURCE in seen:
            raise ValueError(f"stage '{REQUEST_SOURCE}': name: reserved for the client input")
        connectors = dict(self.connectors)
        connectors.setdefault(DEFAULT_CONNECTOR, ConnectorSpec())
        object.__setattr__(self, "connectors", connectors)
        for s in self.stages:
            froms = [e.from_ for e in s.inputs]
            for i, e in enumerate(s.inputs):
                if e.from_ != REQUEST_SOURCE and e.from_ not in seen:
                    raise ValueError(f"stage '{s.name}': inputs[{i}].from: unknown stage '{e.from_}'")
                if e.from_ == s.name:
                    raise ValueError(f"stage '{s.name}': inputs[{i}].from: a stage cannot read itself")
                if froms.count(e.from_) > 1:
                    raise ValueError(f"stage '{s.name}': inputs[{i}].from: '{e.from_}' named twice")
                if e.connector not in connectors:
                    raise ValueError(
                        f"stage '{s.name}': inputs[{i}].connector: '{e.connector}' is not in spec.connectors"
                    )
        if not any(e.from_ == REQUEST_SOURCE for s in self.stages for e in s.inputs):
            raise ValueError("stages: no stage reads `request` (add inputs: [{from: request}])")
        skippable = {s.name for s in self.stages if s.skip_without_media}
        for s in self.stages:
            if s.name in skippable and REQUEST_SOURCE not in (e.from_ for e in s.inputs):
                raise ValueError(
                    f"stage '{s.name}': skipWithoutMedia: it does not read `request`, where media come from"
                )
            if s.name in skippable and s.final_output:
                raise ValueError(
                    f"stage '{s.name}': skipWithoutMedia: a stage with finalOutput cannot be skipped"
                )
            for i, e in enumerate(s.inputs):
                if not e.media and e.from_ != REQUEST_SOURCE:
                    raise ValueError(
                        f"stage '{s.name}': inputs[{i}].media: only a `request` edge carries media"
                    )
                if not e.media and not {f.from_ for f in s.inputs} & skippable:
                    raise ValueError(
                        f"stage '{s.name}': inputs[{i}].media: false, but no input of the stage is a "
                        "skipWithoutMedia stage (an encoder) that reads the media in its place"
                    )
            froms = {e.from_ for e in s.inputs}
            if froms & skippable and froms <= skippable:
                raise ValueError(
                    f"stage '{s.name}': inputs: every input is a skipWithoutMedia stage, so a request "
                    "without media would leave it nothing to read"
                )
        if not any(s.final_output for s in self.stages):
            raise ValueError("stages: no stage has finalOutput, so nothing reaches the client")
        cycle = _find_cycle(self.stages)
        if cycle:
            raise ValueError(f"stage '{cycle[0]}': inputs: cycle {' -> '.join(cycle)}")
        if self.mode is Mode.DISTRIBUTED:
            if placed := next((s for s in self.stages if s.devices or s.share_device), None):
                raise ValueError(
                    f"stage '{placed.name}': devices, shareDevice: SingleNode only (in Distributed mode each "
                    "replica is a pod of its own, placed by Kubernetes' device plugin)"
                )
        else:
            place(self)  # the pod's device count is what it asks for; the supervisor checks the machine's
        return self

    # --- graph queries used by the gateway and the workers --------------------------------

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def consumers(self, producer: str) -> list[tuple[StageSpec, InputSpec]]:
        """The out-edges of `producer`: each consumer stage with its input spec."""
        return [(s, e) for s in self.stages for e in s.inputs if e.from_ == producer]

    def output_kinds(self) -> set[OutputKind]:
        return {s.final_output for s in self.stages if s.final_output}

    def needed_stages(self, outputs: Iterable[OutputKind], media: bool = True) -> list[str]:
        """Stages a request needs to produce `outputs`: their final stages and all ancestors,
        less those that skip a request without media when it has none."""
        wanted = set(outputs)
        needed: set[str] = set()
        stack = [s.name for s in self.stages if s.final_output in wanted]
        while stack:
            name = stack.pop()
            if name in needed or name == REQUEST_SOURCE:
                continue
            if not media and self.stage(name).skip_without_media:
                continue
            needed.add(name)
            stack.extend(e.from_ for e in self.stage(name).inputs)
        return [s.name for s in self.stages if s.name in needed]


class Metadata(_Model):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class PipelineFile(_Model):
    """The document a user writes: the OmniPipeline resource, usable as-is by `omni serve`."""

    api_version: Literal["omnipipeline.dev/v1alpha1"] = "omnipipeline.dev/v1alpha1"
    kind: Literal["OmniPipeline"] = "OmniPipeline"
    metadata: Metadata
    spec: PipelineSpec

    @property
    def name(self) -> str:
        return self.metadata.name


def _find_cycle(stages: list[StageSpec]) -> list[str] | None:
    deps = {s.name: [e.from_ for e in s.inputs if e.from_ != REQUEST_SOURCE] for s in stages}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for d in deps.get(n, []):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[n] = 2
        return None

    for name in deps:
        if name not in state and (found := visit(name)):
            return found
    return None


def _describe(err: dict[str, Any], raw: Any) -> str:
    """Turn one pydantic error into 'stage 'x': field: message', naming the stage by name."""
    loc = list(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith("stage '") or msg.startswith("stages:"):
        return msg
    prefix = ""
    if loc[:2] == ["spec", "stages"] and len(loc) >= 3 and isinstance(loc[2], int):
        stages = raw.get("spec", {}).get("stages", []) if isinstance(raw, dict) else []
        idx = loc[2]
        name = stages[idx].get("name") if idx < len(stages) and isinstance(stages[idx], dict) else None
        prefix = f"stage '{name}': " if name else f"stages[{idx}]: "
        loc = loc[3:]
    field = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
    if err["type"] == "enum" and "expected" in err.get("ctx", {}):
        msg = f"unknown value {err.get('input')!r}, expected {err['ctx']['expected']}"
    return f"{prefix}{field or 'spec'}: {msg}"


def parse_pipeline(raw: Any, source: str = "<pipeline>") -> PipelineFile:
    """Validate a loaded document; raise SpecError with every problem, each naming stage and field."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected an OmniPipeline document (a mapping), got {type(raw).__name__}")
    try:
        return PipelineFile.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(e, raw) for e in exc.errors()]
        raise SpecError(f"{source}: invalid pipeline:\n  " + "\n  ".join(lines)) from None


def load_pipeline(path: str | os.PathLike[str]) -> PipelineFile:
    """Read and validate a pipeline file."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise SpecError(f"{p}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}") from None
    return parse_pipeline(raw, str(p))
