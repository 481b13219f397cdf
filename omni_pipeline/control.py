"""The control plane: NATS subjects and the typed messages that travel on them (connecting to NATS:
omni_pipeline.connection).

Only small things travel here: requests, segment handles (payloads ride inline only below the
connector's threshold), final outputs, errors, aborts and heartbeats. Every message is a
tagged msgspec Struct encoded with `omni_pipeline.wire`; each subscriber has one decoder.
"""

from __future__ import annotations

import logging
import re
import time
from enum import StrEnum
from typing import Any, Final

import msgspec

from omni_pipeline import wire
from omni_pipeline.clips import ClipLimits
from omni_pipeline.connectors.base import ConnectorError, ConnectorHandle, PayloadGone
from omni_pipeline.sampling import Sampling

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S: Final = 1.0
HEARTBEAT_MISSES: Final = 3
"""A replica not heard from for this many intervals is gone."""


class ErrorCode(StrEnum):
    """Why a replica refused a request (Admitted) or ended it (ErrorMsg), or why a gateway did:
    named once, matched by name on both sides (the gateway's MIGRATABLE says which of them a
    fresh route may serve). On the wire as its string, so a code a newer peer sends still
    decodes."""

    BAD_ROUTE = "bad_route"
    """The replica is not on the request's route, or nothing on the route feeds it."""
    UNHEALTHY = "unhealthy"
    """A connector's backend is down: the replica takes nothing new until it answers again."""
    FULL = "full"
    """No slot, or too many bytes of its output wait unread (maxUnreadBytes)."""
    DRAINING = "draining"
    """The replica is stopping (SIGTERM): it finishes what it holds and takes nothing new."""
    SLEEPING = "sleeping"
    """The replica was put to sleep (POST /v1/omni/sleep, or its stage's `paused`); answered 503
    until it wakes."""
    DUPLICATE_REQUEST = "duplicate_request"
    """The replica already holds a request of that id (gateways make ids unique)."""
    ABORTED = "aborted"
    """The request was aborted before this replica admitted it."""
    REPLICA_LOST = "replica_lost"
    """A replica on the route died, stopped, restarted or went silent while serving it."""
    NATS_LOST = "nats_disconnected"
    """A process lost NATS while serving the request, so some of its messages may be gone; the
    request ends at once rather than at its deadline."""
    INVALID_REQUEST = "invalid_request"
    """An engine cannot do what the request asks (a size, a speed); the client's error, 400."""
    DEADLINE_EXCEEDED = "timeout"
    """The request's deadline passed while a stage held it; answered 504, as the gateway's own
    timer is."""
    CONNECTOR_ERROR = "connector_error"
    """A payload could not be stored or fetched (the message names the connector)."""
    PAYLOAD_GONE = "payload_gone"
    """An input's payload no longer existed. Usually the echo of its producer's failure (which
    freed it), so the gateway waits a moment for that root cause."""
    INPUT_ERROR = "input_error"
    """A request's input stream broke (out of order, past its edges' credit)."""
    STAGE_ERROR = "stage_error"
    """The stage's engine failed on this request."""
    CLIENT_TOO_SLOW = "client_too_slow"
    """The gateway's client read its response too slowly; its outputs were dropped and freed."""


def connector_error_code(exc: ConnectorError) -> ErrorCode:
    """The code of a connector's failure: its payload was gone, or the connector failed."""
    return ErrorCode.PAYLOAD_GONE if isinstance(exc, PayloadGone) else ErrorCode.CONNECTOR_ERROR


_TOKEN: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ControlError(RuntimeError):
    """The control plane is misconfigured or unreachable."""


# --- subjects --------------------------------------------------------------------------------


class Subjects:
    """Every NATS subject of one pipeline, built in one place."""

    def __init__(self, pipeline: str) -> None:
        if not _TOKEN.match(pipeline):
            raise ControlError(f"pipeline name {pipeline!r} cannot be a NATS subject token")
        self.base = f"omni.{pipeline}"
        self.abort = f"{self.base}.abort"
        self.heartbeat = f"{self.base}.heartbeat"
        self.control = f"{self.base}.control"

    def stage_inbox(self, stage: str, replica: str) -> str:
        if not (_TOKEN.match(stage) and _TOKEN.match(replica)):
            raise ControlError(f"stage {stage!r} / replica {replica!r} cannot be NATS subject tokens")
        return f"{self.base}.{stage}.{replica}.in"

    def tokenize(self, stage: str) -> str:
        """Where a stage's replicas answer /tokenize and /detokenize (one of them, as a queue group)."""
        if not _TOKEN.match(stage):
            raise ControlError(f"stage {stage!r} cannot be a NATS subject token")
        return f"{self.base}.{stage}.tokenize"

    def clone(self, stage: str) -> str:
        """Where a stage's replicas take a voice from a clip (one of them, as a queue group)."""
        if not _TOKEN.match(stage):
            raise ControlError(f"stage {stage!r} cannot be a NATS subject token")
        return f"{self.base}.{stage}.clone"

    def gateway_inbox(self, gateway_id: str) -> str:
        if not _TOKEN.match(gateway_id):
            raise ControlError(f"gateway id {gateway_id!r} cannot be a NATS subject token")
        return f"{self.base}.gateway.{gateway_id}"


# --- messages --------------------------------------------------------------------------------


class RequestContext(msgspec.Struct, frozen=True):
    """What every stage needs to know about a request; it travels with each of its messages."""

    request_id: str
    route: dict[str, str]
    """stage name -> replica id, for every stage this request needs (and only those)."""
    reply_to: str
    """The gateway inbox that owns the request."""
    deadline: float
    """Unix time after which the request is abandoned."""
    priority: int = 0
    """vLLM's: a replica starts its waiting requests the lower value first (a batch's lines
    after live users' requests)."""


class RequestInputs(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a client asked for, as the source stages read it: model-agnostic (the stage that owns
    a tokenizer applies the chat template). Engines get it as a dict of the fields set."""

    modalities: list[str] = msgspec.field(default_factory=list)
    """The outputs asked for (`text`, `audio`, `image`)."""
    messages: list[dict[str, Any]] | None = None
    """A chat's messages, media parts replaced by references to `RequestPayload.media`."""
    prompt: str | None = None
    """Text to speak, or an image's prompt (no chat template)."""
    negative_prompt: str | None = None
    images: list[str] | None = None
    """Images to edit, as references to `RequestPayload.media` (an image edit's)."""
    voice: str | None = None
    ref_audio: dict[str, Any] | None = None
    """A voice to clone's clip, as a chat's audio part refers to its data: `{"media": key,
    "sample_rate": rate}` (mono float32 samples in `RequestPayload.media`)."""
    voice_print: dict[str, Any] | None = None
    """An uploaded voice's print (omni_pipeline.voices), as references to `RequestPayload.media`:
    `{"x_vector": key}` and, cloned in context, `"codes": key`."""
    tools: list[dict[str, Any]] | None = None
    """The tools a chat offers, for the chat template (whether or not the model may call them)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields set, as an engine reads them."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class RequestPayload(msgspec.Struct, frozen=True):
    """A source stage's copy of the client's request, on its request edge's connector."""

    inputs: RequestInputs
    media: dict[str, Any] = {}
    """Decoded media tensors, by the keys the messages refer to them with."""


class StageRequest(msgspec.Struct, tag="request", frozen=True, omit_defaults=True):
    """A new request, sent by request/reply to every replica on its route (answered by Admitted).

    Stages that read `request` get the client's inputs; for the others it only reserves a slot,
    so admission (full, draining) is decided before any work starts. A source stage's inputs
    come by `payload`, on its request edge's connector, as any stage's inputs do (a
    RequestPayload). Small ones ride inline in the handle; large ones (a long prompt, images)
    wait in shared memory or Mooncake, never in a NATS message, which is capped (1 MiB by
    default). The stage reads its copy once, and the gateway frees it if the request ends
    before that. `inputs` carries them inline instead (tests, benchmarks of the hop itself).
    """

    ctx: RequestContext
    inputs: RequestInputs | None
    sampling: Sampling
    payload: ConnectorHandle | None = None
    own: Sampling = msgspec.field(default_factory=Sampling)
    """This stage's own sampling (vLLM-Omni's `sampling_params_list`), taken whole, over
    `sampling`, whether or not the stage is a source."""


class Admitted(msgspec.Struct, tag="admitted", frozen=True):
    """A replica's answer to a StageRequest: it holds a slot for the request, or says why not."""

    ok: bool
    code: str = ""
    message: str = ""
    unhealthy: str | None = None
    """Why the replica is unhealthy, when that is why it refused (code `unhealthy`)."""


class SegmentMsg(msgspec.Struct, tag="segment", frozen=True):
    """One window's worth of a producer's output for one consumer, by handle."""

    ctx: RequestContext
    from_stage: str
    sequence: int
    is_last: bool
    units: int
    handle: ConnectorHandle


class CreditMsg(msgspec.Struct, tag="credit", frozen=True):
    """A consumer has read `chunks` of a request's chunks from `consumer`'s in-edge: the producer
    may put that many more (flow control: a producer pauses a request that has no credit left,
    so a slow consumer slows its producer instead of filling the connector)."""

    request_id: str
    consumer: str
    chunks: int = 1


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log probability under the model, and the most likely tokens at its
    position (as many as the request's `top_logprobs`), for OpenAI's `logprobs`."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's log probability at a prompt position (vLLM's `prompt_logprobs` entry): its
    id, its log probability under the model given the prompt before it, its rank (1: likeliest)
    and its text."""

    token_id: int
    logprob: float
    rank: int
    token: str


PromptLogprobs = list[list[PromptLogprob] | None]
"""Per prompt position: the prompt's own token first, then the likeliest others asked for; None
at the first position, which nothing predicts."""


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """A function call the model made instead of (or after) its text, for OpenAI's
    `tool_calls`: `arguments` is the JSON text it wrote."""

    id: str
    name: str
    arguments: str


class FinalMsg(msgspec.Struct, tag="final", frozen=True, omit_defaults=True):
    """Client-facing output of a final stage, in order by `sequence`."""

    request_id: str
    stage: str
    replica: str
    kind: str
    sequence: int
    is_last: bool
    text: str = ""
    handle: ConnectorHandle | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    """So far, with this message: `prompt_tokens` the stage read and `completion_tokens`, its
    units (a client's continuous usage stats); the last message's is the request's."""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """On a text stage's last message, where the request asked (vLLM's `prompt_logprobs`)."""
    """For the tokens behind `text`, when the request asked for `logprobs`."""
    tool_calls: list[ToolCall] | None = None
    """The calls the reply ends with, when the request offered `tools`."""


class StageDone(msgspec.Struct, tag="done", frozen=True):
    """A stage without client output finished its part of a request: losing that replica later
    no longer affects the request."""

    request_id: str
    stage: str
    replica: str
    usage: dict[str, int] | None = None
    """What the stage read and made (`prompt_tokens`, `completion_tokens`: its units), for the
    usage a speech or image response reports."""


class ErrorMsg(msgspec.Struct, tag="error", frozen=True):
    """A request failed in a stage; only that request ends."""

    request_id: str
    stage: str
    replica: str
    message: str
    code: str = ErrorCode.STAGE_ERROR


class AbortMsg(msgspec.Struct, tag="abort", frozen=True):
    """Broadcast: every replica drops the request and frees what it holds."""

    request_id: str
    reason: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """A replica announcing itself, its load and its state."""

    stage: str
    replica: str
    instance: str
    """Changes on every process start, so a restart is told apart from a slow heartbeat."""
    pid: int
    host: str
    queued: int
    inflight: int
    capacity: int
    max_queued: int
    draining: bool
    interval_s: float
    metrics_port: int = 0
    stopping: bool = False
    """Sent once when the replica exits: forget it now, do not wait for missed beats."""
    by_gateway: dict[str, int] = msgspec.field(default_factory=dict)
    """Requests held (queued + inflight) per gateway inbox, so each gateway can tell its own
    share of the load from the others' even when the beat lags behind its releases."""
    unhealthy: str = ""
    """Why the replica takes nothing new although it is up (a connector's backend is down):
    gateways route around it until it clears."""
    accepts: list[str] | None = None
    """The kinds of message content part its engine reads from a client's request (`text`,
    `image`, `audio`, `video`), so a gateway refuses the others before any work; None: not
    declared (the engine refuses what it cannot read itself)."""
    honours: list[str] | None = None
    """The request parameters its engine honours as a source stage (`temperature`,
    `logprobs`, ...), so a gateway refuses a request that sets any other; None: not declared."""
    voices: list[str] | None = None
    """The voices its engine speaks in (none: it takes no voice), for the gateway to list and to
    refuse others before any work; None: not declared."""
    languages: list[str] | None = None
    """The languages its engine speaks (a TTS model's names for them), for the gateway to refuse
    others before any work; None: not declared."""
    tokenizes: bool | None = None
    """It answers /tokenize (a source stage whose engine reads text); None: not declared."""
    asleep: int | None = None
    """The sleep level it is at (or going to), None while awake: gateways route around it and
    answer 503 for the requests that need it."""
    audio_ahead: bool = False
    """Its engine encodes a live session's audio as it arrives (AudioInMsg), so a gateway sends
    the audio ahead to the replica the session's responses are pinned to."""
    max_sleep_level: int | None = None
    """The deepest sleep its engine can do (see SleepMsg); None: it cannot be put to sleep."""
    clip_limits: ClipLimits | None = None
    """What its engine can make of a video (a video denoiser's), once loaded: a gateway refuses
    a video job beyond it before queueing it."""
    ts: float = msgspec.field(default_factory=time.time)


SLEEP_MODES: Final = ("abort", "wait")


class SleepMsg(msgspec.Struct, tag="sleep", frozen=True):
    """Broadcast on the control subject: every replica of `stages` stops admitting, ends what it
    holds (`mode`: `abort` fails it, `wait` lets it finish) and frees its engine's memory by
    `level`, as vLLM's sleep levels: 0 frees nothing, 1 moves the weights off the accelerator
    into host memory, 2 drops them (waking loads them again). Each answers a SleepAck once
    asleep, to the message's reply subject."""

    stages: list[str]
    level: int
    mode: str


class WakeMsg(msgspec.Struct, tag="wake", frozen=True):
    """Broadcast on the control subject: every sleeping replica of `stages` restores what its
    sleep freed and admits again; each answers a SleepAck."""

    stages: list[str]


class ForgetPromptMsg(msgspec.Struct, tag="forget_prompt", frozen=True):
    """Broadcast on the control subject: every replica gives up the sequence it keeps for this
    `prompt_cache_key` (its live session closed). Nothing answers."""

    key: str


class AudioInMsg(msgspec.Struct, tag="audio_in", frozen=True):
    """To the replica of the source stage a live session's next response will run on, whose
    engine encodes audio ahead (`Heartbeat.audio_ahead`): a piece of the session's input audio
    as it is appended, 16-bit little-endian mono PCM at `rate`, from sample `start` of the
    turn (0 begins a turn). Keyed by the session's `prompt_cache_key`, which its responses
    carry. Nothing answers: a replica that misses a piece only encodes less ahead."""

    key: str
    start: int
    pcm: bytes
    rate: int


class SleepAck(msgspec.Struct, tag="sleep_ack", frozen=True):
    """A replica's answer to a SleepMsg or WakeMsg, once done (or failed: `ok` false)."""

    stage: str
    replica: str
    instance: str
    ok: bool
    asleep: int | None
    """Its sleep level now; None: awake."""
    seconds: float
    freed_bytes: int = 0
    """Weight bytes the sleep took off the engine's device (0 for a wake)."""
    rss_bytes_before: int = 0
    rss_bytes_after: int = 0
    """The process's resident memory before and after."""
    message: str = ""


class TokenizeMsg(msgspec.Struct, tag="tokenize", frozen=True, omit_defaults=True):
    """POST /tokenize, asked of a source stage (by request/reply): the prompt or messages as its
    engine would read them, with vLLM's options."""

    inputs: RequestInputs
    add_special_tokens: bool = False
    return_token_strs: bool = False
    template: Sampling = msgspec.field(default_factory=Sampling)
    """The chat template's arguments, as a request's sampling carries them
    (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`)."""


class DetokenizeMsg(msgspec.Struct, tag="detokenize", frozen=True):
    """POST /detokenize, asked of a source stage: token ids back to text."""

    tokens: list[int]


class TokenizeReply(msgspec.Struct, tag="tokenized", frozen=True, omit_defaults=True):
    """A stage's answer to either: the ids (and their texts), or the text; or why not
    (`code`: INVALID_REQUEST is the client's error)."""

    ok: bool
    tokens: list[int] = []
    token_strs: list[str] = []
    prompt: str = ""
    max_model_len: int = 0
    code: str = ""
    message: str = ""


ControlInbound = SleepMsg | WakeMsg | ForgetPromptMsg
TokenizeInbound = TokenizeMsg | DetokenizeMsg
StageInbound = StageRequest | SegmentMsg | CreditMsg | AudioInMsg
GatewayInbound = FinalMsg | ErrorMsg | StageDone


def pack(msg: msgspec.Struct) -> bytes:
    return wire.encode(msg)


def unpack(data: bytes, type_: Any) -> Any:
    """Decode one control message; raises wire.WireError on anything that is not one."""
    return wire.decode(data, type_)
