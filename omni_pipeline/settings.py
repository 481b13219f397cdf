"""The pipeline's settings beyond its stages: connectors, Mooncake, NATS, the gateway, traces and
what every pod gets. Part of the one spec model (omni_pipeline.spec), camelCase on the wire."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Every part of the spec: camelCase on the wire, snake_case in Python, nothing unknown, frozen."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ConnectorKind(StrEnum):
    INLINE = "inline"
    SHM = "shm"
    MOONCAKE = "mooncake"


class ConnectorSpec(SpecModel):
    kind: ConnectorKind = Field(default=ConnectorKind.SHM, description="inline, shm or mooncake.")
    inline_threshold_bytes: int = Field(
        default=65536, ge=0, description="Payloads smaller than this ride inside the control message."
    )
    pool_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="shm, mooncake: memory each process keeps warm for reuse; idle beyond it is freed.",
    )


class MooncakeSpec(SpecModel):
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
    rpc_timeout_ms: int = Field(
        default=5000,
        ge=100,
        description=(
            "How long a call to mooncake_master waits for its answer (MC_RPC_TIMEOUT_MS overrides; "
            "Mooncake's own default is 30 s). A master that stops answering (a stalled host) fails the "
            "call that waited on it within this, not each call queued behind it half a minute apiece."
        ),
    )
    tcp_status_timeout_s: int = Field(
        default=5,
        ge=1,
        description=(
            "How long a TCP transfer waits for the store server to answer it before any payload moves "
            "(MC_TCP_STATUS_TIMEOUT_SEC overrides; Mooncake's own default is 30 s). Streaming the "
            "payload itself is not bounded by it."
        ),
    )


class SecretKeyRef(SpecModel):
    name: str = Field(description="Secret name, in the pipeline's namespace.")
    key: str = Field(description="Key in the Secret.")


class NatsSpec(SpecModel):
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


class MediaSpec(SpecModel):
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
    max_image_bytes: int = Field(
        default=16 << 20,
        ge=1,
        description="Largest image file uploaded to /v1/images/edits (each image and the mask); the body as "
        "a whole is within maxRequestBytes.",
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


class RealtimeSpec(SpecModel):
    max_sessions: int = Field(
        default=64,
        ge=0,
        description="Live sessions (WS /v1/realtime) a gateway replica holds at once; beyond it the upgrade "
        "is refused with a 429. 0: no live sessions.",
    )
    idle_timeout_s: float = Field(
        default=300.0, gt=0, description="A session with no client event for this long is closed (1000)."
    )
    max_session_s: float = Field(
        default=3600.0, gt=0, description="A session is closed (1000) after this long."
    )
    resume_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="A full-duplex session (/v1/realtime?duplex=1) whose socket drops is kept this long for "
        "the client to resume it (session.resume); its events are kept for replay meanwhile. 0: not kept.",
    )
    resume_journal_bytes: int = Field(
        default=8 << 20,
        ge=0,
        description="Bytes of a full-duplex session's events kept until the client acknowledges them "
        "(session.event_ack), for replay on resume; beyond it the session is told to resync.",
    )


class VideoJobsSpec(SpecModel):
    """Video generation jobs (/v1/videos): where they are kept, and how many may wait."""

    store: Literal["auto", "sqlite", "jetstream"] = Field(
        default="auto",
        description="Where jobs are kept: sqlite (and files) under stateDir, or NATS JetStream's key-value "
        "and object stores (the pipeline's NATS must have JetStream on). auto: sqlite in SingleNode, "
        "jetstream otherwise.",
    )
    state_dir: str = Field(
        default=".omni-state",
        description="The directory (relative: to the working directory) holding the SQLite job store and the "
        "videos, under the pipeline's name (with JetStream: the local copies of videos being served).",
    )
    concurrency: int = Field(default=2, ge=1, description="Jobs a gateway replica runs at once.")
    max_queued: int = Field(
        default=256, ge=1, description="Jobs queued or running in all; a job beyond it is refused (429)."
    )
    max_queued_per_key: int = Field(
        default=16,
        ge=1,
        description="Jobs queued or running per API key (all clients share one key when keys are off); "
        "beyond it, 429.",
    )
    retention_s: float = Field(
        default=86400.0,
        gt=0,
        description="A finished job (and its files) is kept this long after it ends, then deleted "
        "(its expires_at).",
    )
    max_video_bytes: int = Field(
        default=1 << 30, ge=1 << 10, description="Largest video file a job may write; a larger one fails it."
    )
    timeout_s: float = Field(default=3600.0, gt=0, description="A job's deadline once it runs.")
    lease_s: float = Field(
        default=15.0,
        gt=0,
        description="A running job's lease: renewed while its gateway lives; a job whose lease lapses (its "
        "gateway died or was replaced) is taken up by the next gateway that looks, one only.",
    )


class VoicesSpec(SpecModel):
    """Voices people upload (POST /v1/audio/voices): where they are kept, how many, and what a
    clip may be."""

    store: Literal["auto", "sqlite", "jetstream"] = Field(
        default="auto",
        description="Where voices are kept: sqlite under stateDir, or a NATS JetStream key-value bucket "
        "(the pipeline's NATS must have JetStream on). auto: sqlite in SingleNode, jetstream otherwise.",
    )
    state_dir: str = Field(
        default=".omni-state",
        description="The directory (relative: to the working directory) holding the SQLite voice store, "
        "under the pipeline's name.",
    )
    max_voices: int = Field(default=64, ge=1, description="Voices kept in all; an upload beyond it is a 400.")
    min_clip_s: float = Field(default=0.5, gt=0, description="Shortest clip a voice is taken from.")
    max_clip_s: float = Field(default=30.0, gt=0, description="Longest clip a voice is taken from.")
    max_clip_bytes: int = Field(default=10 << 20, ge=1024, description="Largest clip file an upload sends.")


class BatchesSpec(SpecModel):
    """The Batch API (/v1/files, /v1/batches): where files and batches are kept, how large a
    file may be, and how much of the pipeline a gateway's batches may use at once."""

    store: Literal["auto", "sqlite", "jetstream"] = Field(
        default="auto",
        description="Where files and batches are kept: sqlite (and files) under stateDir, or NATS "
        "JetStream's key-value and object stores (the pipeline's NATS must have JetStream on). auto: sqlite "
        "in SingleNode, jetstream otherwise.",
    )
    state_dir: str = Field(
        default=".omni-state",
        description="The directory (relative: to the working directory) holding the SQLite batch store and "
        "the files, under the pipeline's name (with JetStream: local copies of the files read).",
    )
    max_file_bytes: int = Field(
        default=200 << 20,
        ge=1 << 10,
        description="Largest file an upload may be (OpenAI's: 200 MB); larger, 413.",
    )
    max_lines: int = Field(
        default=50_000, ge=1, description="Most requests one batch's input file may hold (OpenAI's: 50,000)."
    )
    concurrency: int = Field(
        default=2,
        ge=1,
        description="A gateway replica's batch requests running at once, all its batches together: what "
        "the pipeline's interactive users leave to batches.",
    )
    live_priority: int = Field(
        default=2,
        ge=0,
        description="Batch lines each live request this gateway serves keeps from starting: lines start "
        "while those running plus this many per live request stay under concurrency. 1: lines fill the "
        "slots live users leave; 2 (measured on a CPU, where every row of a step costs): live TTFP "
        "during a batch as without one; 0: batches ignore live users.",
    )
    output_retention_s: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="How long a batch's output and error files are kept, unless the batch's "
        "output_expires_after says otherwise (OpenAI's default: 30 days).",
    )
    lease_s: float = Field(
        default=15.0,
        gt=0,
        description="A running batch's lease: renewed while its gateway lives; a batch whose lease lapses "
        "(its gateway died) is taken up by the next gateway that looks, one only.",
    )


class GatewaySpec(SpecModel):
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
    voices: VoicesSpec = Field(default_factory=VoicesSpec, description="Voices people upload.")
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
    realtime: RealtimeSpec = Field(default_factory=RealtimeSpec, description="Limits on live sessions.")
    videos: VideoJobsSpec = Field(default_factory=VideoJobsSpec, description="Video generation jobs.")
    batches: BatchesSpec = Field(
        default_factory=BatchesSpec, description="The Batch API's files and batches."
    )


class ObservabilitySpec(SpecModel):
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


class PodsSpec(SpecModel):
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
