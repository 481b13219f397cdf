"""OpenAI's Realtime protocol (GA event names), the subset served: the client's events as typed
structs, and the error a bad one gets.

Every field a client may send is declared; any other is refused by name (an `error` event whose
`param` is its path), never ignored. Fields of the protocol that this server does not serve
(tools, transcription of the input, noise reduction, the G.711 formats, semantic VAD) are
refused the same way, with a message that says so.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Final, Literal

import msgspec

PCM_RATE: Final = 24000
"""`audio/pcm` is 16-bit little-endian mono at 24 kHz, in and out."""
PCM_FORMAT: Final = {"type": "audio/pcm", "rate": PCM_RATE}
"""The one audio format served, as sessions and responses show it."""


class RealtimeError(Exception):
    """A client event that cannot be served; the session answers with an `error` event and goes on."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A client's struct: a field it does not declare is refused by name."""


class AudioFormat(Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = PCM_RATE


Ms = Annotated[int, msgspec.Meta(ge=0, le=60_000)]


class ServerVad(Strict):
    type: Literal["server_vad"] = "server_vad"
    threshold: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.5
    prefix_padding_ms: Ms = 300
    silence_duration_ms: Ms = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None


class AudioInput(Strict):
    format: AudioFormat | msgspec.UnsetType = msgspec.UNSET
    turn_detection: ServerVad | msgspec.UnsetType | None = msgspec.UNSET
    transcription: None = None
    noise_reduction: None = None


class AudioOutput(Strict):
    format: AudioFormat | msgspec.UnsetType = msgspec.UNSET
    voice: str | msgspec.UnsetType | None = msgspec.UNSET
    speed: float | msgspec.UnsetType = msgspec.UNSET


class AudioConfig(Strict):
    input: AudioInput | msgspec.UnsetType = msgspec.UNSET
    output: AudioOutput | msgspec.UnsetType = msgspec.UNSET


Modality = Literal["text", "audio"]
MaxTokens = int | Literal["inf"]


class SessionConfig(Strict):
    """`session.update`'s `session`: what it sets; UNSET leaves a field as it was."""

    type: Literal["realtime"] = "realtime"
    model: str | msgspec.UnsetType = msgspec.UNSET
    output_modalities: list[Modality] | msgspec.UnsetType = msgspec.UNSET
    instructions: str | msgspec.UnsetType = msgspec.UNSET
    max_output_tokens: MaxTokens | msgspec.UnsetType = msgspec.UNSET
    audio: AudioConfig | msgspec.UnsetType = msgspec.UNSET


class ContentPart(Strict):
    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None
    """Base64 PCM16 at 24 kHz."""
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class Item(Strict):
    """A conversation item as a client creates it: messages only (function calls are not served)."""

    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart]
    id: str | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ResponseAudioOutput(Strict):
    format: AudioFormat | msgspec.UnsetType = msgspec.UNSET
    voice: str | msgspec.UnsetType = msgspec.UNSET


class ResponseAudio(Strict):
    output: ResponseAudioOutput | msgspec.UnsetType = msgspec.UNSET


class ResponseParams(Strict):
    """`response.create`'s `response`: this response's overrides of the session."""

    conversation: Literal["auto", "none"] = "auto"
    input: list[Item] | None = None
    instructions: str | msgspec.UnsetType = msgspec.UNSET
    output_modalities: list[Modality] | msgspec.UnsetType = msgspec.UNSET
    max_output_tokens: MaxTokens | msgspec.UnsetType = msgspec.UNSET
    audio: ResponseAudio | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, str] | None = None


class EventBase(Strict, tag_field="type"):
    """A client event: tagged by its `type`, with the client's own `event_id` to echo in errors."""

    event_id: str | None = None


class SessionUpdate(EventBase, tag="session.update"):
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)


class AudioAppend(EventBase, tag="input_audio_buffer.append"):
    audio: str = ""


class AudioCommit(EventBase, tag="input_audio_buffer.commit"):
    pass


class AudioClear(EventBase, tag="input_audio_buffer.clear"):
    pass


class ItemCreate(EventBase, tag="conversation.item.create"):
    item: Item | None = None
    previous_item_id: str | None = None


class ItemRetrieve(EventBase, tag="conversation.item.retrieve"):
    item_id: str = ""


class ItemTruncate(EventBase, tag="conversation.item.truncate"):
    item_id: str = ""
    content_index: int = 0
    audio_end_ms: int = 0


class ItemDelete(EventBase, tag="conversation.item.delete"):
    item_id: str = ""


class ResponseCreate(EventBase, tag="response.create"):
    response: ResponseParams = msgspec.field(default_factory=ResponseParams)


class ResponseCancel(EventBase, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemRetrieve
    | ItemTruncate
    | ItemDelete
    | ResponseCreate
    | ResponseCancel
)

_DECODER: Final = msgspec.json.Decoder(ClientEvent)

NOT_SERVED: Final = {
    "tools": "function calling is not served on this socket",
    "tool_choice": "function calling is not served on this socket",
    "transcription": "input transcription is not served (the model hears the audio itself)",
    "noise_reduction": "noise reduction is not served",
    "semantic_vad": "semantic_vad is not served: use server_vad",
    "idle_timeout_ms": "idle_timeout_ms is not served",
    "video_frames": "camera frames are not served with live audio here",
    "ref_audio": "voice cloning is not served",
}
_UNKNOWN: Final = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")
_MISSING: Final = re.compile(r"Object missing required field `([^`]+)`")
_AT: Final = re.compile(r"^(.*?)(?: - at `\$\.?([^`]*)`)?$")


def parse_event(data: str | bytes, decoder: msgspec.json.Decoder[Any] = _DECODER) -> Any:
    """A client event (of `decoder`'s union: GA's, or a dialect's), or RealtimeError naming
    what is wrong with it."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _refusal(str(exc), data) from None
    except msgspec.DecodeError:
        raise RealtimeError("the message is not a JSON object", code="invalid_json") from None


def _refusal(message: str, data: str | bytes) -> RealtimeError:
    if m := _UNKNOWN.match(message):
        name, where = m.group(1), _path(m.group(2) or "")
        param = f"{where}.{name}" if where else name
        why = NOT_SERVED.get(name, "not a field of this event (or not served)")
        return RealtimeError(f"{param}: {why}", code="unknown_parameter", param=param)
    text, where = _AT.match(message).groups()  # type: ignore[union-attr]
    param = _path(where or "") or None
    if "semantic_vad" in text:
        return RealtimeError(f"{param}: {NOT_SERVED['semantic_vad']}", param=param)
    if param is not None and param.endswith(("format.type", "format.rate")):
        return RealtimeError(f"{param}: only audio/pcm at {PCM_RATE} Hz is served ({text})", param=param)
    if param is not None and (why := NOT_SERVED.get(param.rsplit(".", 1)[-1])):
        return RealtimeError(f"{param}: {why}", param=param)
    if text.startswith("Invalid value") and param == "type":
        return RealtimeError(
            f"type: unknown event type {_event_type(data)!r}", code="invalid_event", param="type"
        )
    if text.startswith("Object missing required field `type`") and not param:
        return RealtimeError("type: every event names its type", code="invalid_event", param="type")
    if m := _MISSING.match(text):
        missing = f"{param}.{m.group(1)}" if param else m.group(1)
        return RealtimeError(f"{missing}: required", code="missing_required_parameter", param=missing)
    return RealtimeError(f"{param}: {text}" if param else text, param=param)


def _path(where: str) -> str:
    """msgspec's `$.session.audio[0]` -> `session.audio.0`."""
    return re.sub(r"\[(\d+)\]", r".\1", where).strip(".")


def _event_type(data: str | bytes) -> Any:
    try:
        return msgspec.json.decode(data).get("type")
    except (msgspec.DecodeError, AttributeError):
        return None


def client_event_id(data: str | bytes) -> str | None:
    """The `event_id` of a message that did not parse as an event, to echo in its error."""
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    event_id = value.get("event_id") if isinstance(value, dict) else None
    return event_id if isinstance(event_id, str) else None
