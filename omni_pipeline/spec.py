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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from omni_pipeline.placement import place

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


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


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


class ConnectorKind(StrEnum):
    INLINE = "inline"
    SHM = "shm"
    MOONCAKE = "mooncake"


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
        default=None, description="If set, this stage's output goes to the client as text, audio or image."
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


class ConnectorSpec(_Model):
    kind: ConnectorKind = Field(default=ConnectorKind.SHM, description="inline, shm or mooncake.")
    inline_threshold_bytes: int = Field(
        default=65536, ge=0, description="Payloads smaller than this ride inside the control message."
    )
    pool_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="shm, mooncake: memory each process keeps warm for reuse; idle beyond it is freed.",
    )


class MooncakeSpec(_Model):
    """Where the Mooncake store is, for connectors of kind `mooncake` (env vars override)."""

    master_server_address: str = Field(default="", description="mooncake_master RPC address, host:port.")
    metadata_server: str = Field(
        default="",
        description="Transfer-engine metadata: http://host:port/metadata, etcd://..., or P2PHANDSHAKE.",
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transfer protocol.")
    device_name: str = Field(default="", description="RDMA device(s), for protocol rdma.")
    global_segment_size_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "Memory each omni process contributes to the store. 0 (the default): none, the data lives in "
            "store servers (mooncake_client), so a stage that exits or crashes takes no other request's "
            "payloads with it."
        ),
    )
    local_buffer_size_bytes: int = Field(
        default=64 << 20, ge=1 << 20, description="Client-side transfer buffer."
    )


class SecretKeyRef(_Model):
    name: str = Field(description="Secret name, in the pipeline's namespace.")
    key: str = Field(description="Key in the Secret.")


class NatsSpec(_Model):
    url: str = Field(default="", description="NATS URL; empty in SingleNode starts an embedded server.")
    url_secret: SecretKeyRef | None = Field(
        default=None,
        description="Read the NATS URL from this Secret instead: with a token or user and password in "
        "it (nats://TOKEN@host:4222, nats://user:password@host:4222).",
    )
    creds_secret: str | None = Field(
        default=None,
        description="Kubernetes: a Secret whose `creds` entry is a NATS credentials file (JWT and NKey). "
        "Elsewhere: OMNI_NATS_CREDS.",
    )
    tls_secret: str | None = Field(
        default=None,
        description="Kubernetes: a Secret whose `ca.crt` signed the NATS server's certificate (as "
        "cert-manager writes them). Elsewhere: OMNI_NATS_TLS_CA.",
    )
    tls_client_cert: bool = Field(
        default=False,
        description="Mutual TLS: tlsSecret also holds our client certificate, `tls.crt` and `tls.key`. "
        "Elsewhere: OMNI_NATS_TLS_CERT and OMNI_NATS_TLS_KEY.",
    )

    @model_validator(mode="after")
    def _client_cert_needs_secret(self) -> NatsSpec:
        if self.tls_client_cert and self.tls_secret is None:
            raise ValueError("tlsClientCert needs tlsSecret")
        return self


API_KEYS_ENV: Final = "OMNI_API_KEYS"
"""Comma-separated API keys the gateway requires (with API_KEYS_FILE_ENV; neither set: none)."""
API_KEYS_FILE_ENV: Final = "OMNI_API_KEYS_FILE"
"""A file of API keys, one per line, `#` comments."""


class MediaSpec(_Model):
    """What the gateway accepts as media input (chat content parts `image_url`, `input_audio`,
    `video_url`).
    Every part is decoded once, at the gateway, and checked against these before any stage
    sees it; over a limit is a 400 naming the part."""

    max_parts: int = Field(default=8, ge=0, le=256, description="Media parts in one request, all messages.")
    max_audio_seconds: float = Field(
        default=300.0, gt=0, description="Longest audio part (Qwen2.5-Omni's feature extractor takes 300 s)."
    )
    max_image_pixels: int = Field(
        default=4096 * 4096, ge=1, description="Largest image part, width x height, checked before decoding."
    )
    video_fps: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Frames per second taken from a video part (Qwen's processors sample 2); a video with "
        "fewer keeps all of its own.",
    )
    max_video_frames: int = Field(
        default=128, ge=1, description="Most frames taken from one video part (at videoFps)."
    )
    max_video_pixels: int = Field(
        default=1 << 27,
        ge=1,
        description="Most pixels of all frames taken from one video part (frames x width x height; 3 bytes "
        "each once decoded); each frame also within maxImagePixels.",
    )
    fetch_urls: bool = Field(
        default=False,
        description="Fetch http(s) image and video URLs; off: only data: URLs (a URL is a 400).",
    )
    fetch_timeout_s: float = Field(default=10.0, gt=0, le=300, description="Time limit of one URL fetch.")
    fetch_max_bytes: int = Field(default=20 << 20, ge=1, description="Largest body a URL fetch may return.")


class GatewaySpec(_Model):
    replicas: int = Field(default=1, ge=1, description="Gateway replicas (Distributed mode).")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port of the gateway.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="A request's deadline.")
    max_request_bytes: int = Field(
        default=16 << 20, ge=1024, description="Largest request body the gateway reads; larger ones get 413."
    )
    max_tokens: int = Field(
        default=32768,
        ge=1,
        description="Most tokens a request may ask for (max_tokens, max_completion_tokens); more gets 400.",
    )
    api_keys_secret: str | None = Field(
        default=None,
        description="Kubernetes: a Secret whose `keys` entry (one key per line) the gateway requires as "
        "`Authorization: Bearer`. Elsewhere: OMNI_API_KEYS or OMNI_API_KEYS_FILE.",
    )
    media: MediaSpec = Field(default_factory=MediaSpec, description="Limits on media input parts.")
    migration_limit: int = Field(
        default=2,
        ge=0,
        description="Times a request may run again on a fresh route when a replica on its route is lost "
        "(dies, goes silent, restarts) or refuses it (draining, full, unhealthy); 0: never.",
    )
    replica_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a request waits for a stage with no live replica (one restarting) or for "
        "NATS to come back, within its deadline, before a 503.",
    )
    max_waiting_requests: int = Field(
        default=256,
        ge=0,
        description="Requests that may wait so at once; more get a 503 at once.",
    )


class ObservabilitySpec(_Model):
    otlp_endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="OpenTelemetry collector that every process sends its traces to, as a base URL "
        "(http://collector:4318 for OTLP/HTTP; with OTEL_EXPORTER_OTLP_PROTOCOL=grpc, port 4317). "
        "OTEL_EXPORTER_OTLP_ENDPOINT in a process's environment wins over it. Unset: no traces.",
    )


RESERVED_VOLUMES: Final = frozenset({"pipeline", "dshm", "api-keys", "nats-creds", "nats-tls"})
"""Volumes rendered pods may already have: the pipeline ConfigMap, /dev/shm, the gateway's API
keys, NATS credentials and TLS files."""


class PodsSpec(_Model):
    """Kubernetes only (`omni serve` ignores it): what every pod of the pipeline gets on top of
    what the operator renders; how model weights and credentials reach the engines."""

    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra container env (Kubernetes EnvVar objects), e.g. HF_TOKEN from a Secret.",
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra pod volumes (Kubernetes Volume objects), e.g. a PVC holding model weights.",
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Where the extra volumes are mounted (Kubernetes VolumeMount objects).",
    )
    service_account_name: str | None = Field(default=None, description="The pods' ServiceAccount.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets to pull the image with.")

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> PodsSpec:
        names = [v.get("name") for v in self.volumes]
        for i, name in enumerate(names):
            if not name:
                raise ValueError(f"pods: volumes[{i}].name: required")
            if name in RESERVED_VOLUMES:
                raise ValueError(f"pods: volumes[{i}].name: '{name}' is reserved")
        for i, m in enumerate(self.volume_mounts):
            if m.get("name") not in names:
                raise ValueError(f"pods: volumeMounts[{i}].name: no volume named '{m.get('name')}'")
            if not m.get("mountPath"):
                raise ValueError(f"pods: volumeMounts[{i}].mountPath: required")
        for i, e in enumerate(self.env):
            if not e.get("name"):
                raise ValueError(f"pods: env[{i}].name: required")
        return self


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
