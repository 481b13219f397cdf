"""vLLM-Omni's full-duplex dialect of the Realtime protocol (`/v1/realtime?duplex=1`, `/v1/duplex`),
the subset served: its client events as typed structs, beside GA's.

Its `session.update` is the shape vLLM-Omni's `DuplexClient` sends (`modalities`, the input's
`sample_rate_hz`, top-level `turn_detection`, `extra_body.auto_response`); its append and commit
carry a few more fields; and it adds events GA has none of (acknowledging server events,
resuming, playback progress, barge-in, heartbeats, an explicit close). Every field is declared,
and one that is not served is refused by name (`protocol.parse_event`), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from omni_gateway.realtime.protocol import (
    PCM_RATE,
    AudioClear,
    EventBase,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    MaxTokens,
    Modality,
    ResponseCancel,
    ResponseCreate,
    ServerVad,
    SessionConfig,
    Strict,
)

PCM16: Final = "pcm16"
"""The dialect's name for 16-bit little-endian mono PCM, the one encoding served."""
DEFAULT_INPUT_RATE: Final = 16000
"""A duplex client's input rate unless it says otherwise (vLLM-Omni's default)."""
InputRate = Annotated[int, msgspec.Meta(ge=8000, le=48000)]
Count = Annotated[int, msgspec.Meta(ge=0)]


OverlapPolicy = Literal["listen_only", "barge_in_on_speech"]
"""Speech heard (by server VAD) while an answer plays: heard as the next turn, or the answer cut."""
PlaybackPolicy = Literal["commit_all_on_done", "ack_only"]
"""What of an answer the conversation keeps: all of it once done (cut to what was played only
at a barge-in), or only what the client acknowledged as played."""


class DuplexAudioInput(Strict):
    sample_rate_hz: InputRate | msgspec.UnsetType = msgspec.UNSET
    format: Literal["pcm16"] | msgspec.UnsetType = msgspec.UNSET
    turn_detection: ServerVad | msgspec.UnsetType | None = msgspec.UNSET


class DuplexAudioOutput(Strict):
    sample_rate_hz: Literal[24000] | msgspec.UnsetType = msgspec.UNSET
    format: Literal["pcm16"] | msgspec.UnsetType = msgspec.UNSET
    voice: str | msgspec.UnsetType | None = msgspec.UNSET


class DuplexAudio(Strict):
    input: DuplexAudioInput | msgspec.UnsetType = msgspec.UNSET
    output: DuplexAudioOutput | msgspec.UnsetType = msgspec.UNSET


class ExtraBody(Strict):
    auto_response: bool | msgspec.UnsetType = msgspec.UNSET
    """A final commit starts a response by itself (True, the default)."""


class DuplexSessionConfig(SessionConfig):
    """The duplex `session.update`'s `session`: GA's fields (its `audio` the dialect's), and the
    dialect's; UNSET leaves a field as it was."""

    audio: DuplexAudio | msgspec.UnsetType = msgspec.UNSET  # type: ignore[assignment]
    modalities: list[Modality] | msgspec.UnsetType = msgspec.UNSET
    voice: str | msgspec.UnsetType | None = msgspec.UNSET
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | msgspec.UnsetType = msgspec.UNSET
    max_response_output_tokens: MaxTokens | msgspec.UnsetType = msgspec.UNSET
    input_audio_format: Literal["pcm16"] | msgspec.UnsetType = msgspec.UNSET
    output_audio_format: Literal["pcm16"] | msgspec.UnsetType = msgspec.UNSET
    sample_rate_hz: InputRate | msgspec.UnsetType = msgspec.UNSET
    """The input's rate (the output is 24 kHz)."""
    turn_detection: ServerVad | msgspec.UnsetType | None = msgspec.UNSET
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | msgspec.UnsetType = msgspec.UNSET
    overlap_policy: OverlapPolicy | msgspec.UnsetType = msgspec.UNSET
    playback_commit_policy: PlaybackPolicy | msgspec.UnsetType = msgspec.UNSET
    extra_body: ExtraBody | msgspec.UnsetType = msgspec.UNSET


class DuplexSessionUpdate(EventBase, tag="session.update"):
    session: DuplexSessionConfig = msgspec.field(default_factory=DuplexSessionConfig)


class DuplexAppend(EventBase, tag="input_audio_buffer.append"):
    audio: str = ""
    format: Literal["pcm16"] = PCM16
    sample_rate_hz: InputRate | None = None
    """This piece's rate; it must be the session's."""
    duration_ms: Count | None = None
    audio_end_ms: Count | None = None
    """The client's own clock (what it has appended so far), kept in no state of ours."""
    is_speech: bool | None = None
    """False: the client says this piece is not speech (VAD hears it as silence)."""
    video_frames: Annotated[list[str], msgspec.Meta(max_length=0)] = msgspec.field(default_factory=list)
    """Not served: the models here take no camera frames with live audio."""


class DuplexCommit(EventBase, tag="input_audio_buffer.commit"):
    final: bool = True
    """False: the user's item ends here, but not their turn (no response)."""
    response_create: bool | None = None
    """Forces a response (True) or none (False); None: `auto_response` decides a final commit."""
    is_speech: bool | None = None
    """False: what was appended is not speech; it is dropped, not made an item."""


class EventAck(EventBase, tag="session.event_ack"):
    server_event_seq: Count = 0


class SessionResume(EventBase, tag="session.resume"):
    session_id: str = ""
    resume_token: str = ""
    last_received_server_event_seq: Count = 0


class Heartbeat(EventBase, tag="session.heartbeat"):
    pass


class SessionClose(EventBase, tag="session.close"):
    reason: str = "client_close"


class PlaybackAck(EventBase, tag="playback.ack", kw_only=True):
    played_ms: Count
    committed_ms: Count | None = None
    response_id: str | None = None
    item_id: str | None = None


class BargeIn(EventBase, tag="barge_in"):
    pass


class InputCancel(EventBase, tag="input.cancel"):
    pass


class TextAppend(EventBase, tag="input.text.append", kw_only=True):
    text: Annotated[str, msgspec.Meta(min_length=1)]


DuplexClientEvent = (
    DuplexSessionUpdate
    | DuplexAppend
    | DuplexCommit
    | AudioClear
    | ItemCreate
    | ItemRetrieve
    | ItemTruncate
    | ItemDelete
    | ResponseCreate
    | ResponseCancel
    | EventAck
    | SessionResume
    | Heartbeat
    | SessionClose
    | PlaybackAck
    | BargeIn
    | InputCancel
    | TextAppend
)

DUPLEX_DECODER: Final = msgspec.json.Decoder(DuplexClientEvent)

CAPABILITIES: Final = {
    "implementation_level": "turn_based_duplex",
    "supports_model_native_turn_policy": False,
    "supports_client_commit": True,
    "supports_barge_in": True,
    "supports_playback_ack": True,
    "supports_input_append": True,
    "supports_text_only_turn": True,
    "supports_session_resume": True,
    "supports_audio_truncate": True,
    "supports_image_input": False,
    "required_input_modalities": [],
    "optional_input_modalities": ["audio", "text"],
    "input_modes": ["append_audio_chunk"],
    "signal_sources": ["client_event", "server_vad"],
}
"""What a session here can do, as vLLM-Omni's sessions say it: no model served here decides
turns itself while it speaks, so each is vLLM-Omni's documented fallback, turn-based duplex."""
OUTPUT_RATE: Final = PCM_RATE
