"""POST /v1/audio/speech: its request model, and what the pipeline gets of it."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_gateway.request import PipelineRequest
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import EVERY_ENGINE, Sampling, params
from omni_pipeline.spec import OutputKind

SPEECH_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
"""The speech formats served, and the Content-Type of each."""


class SpeechRequest(BaseModel):
    """POST /v1/audio/speech. `response_format` defaults to wav (OpenAI's mp3 needs an encoder
    this server does not have); `stream_format` sse sends base64 deltas instead of raw audio."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="A voice name, or OpenAI's {id: ...}; without it, the model's default voice.",
    )
    instructions: str | None = Field(
        default=None,
        max_length=4096,
        description="How to speak (a named voice's style, or a voice described); "
        "a 400 where the model follows none.",
    )
    response_format: str = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    # vLLM-Omni's speech fields.
    language: str | None = Field(default=None, min_length=1, max_length=64)
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="The source stage's budget (a TTS talker's: frames of codes)."
    )
    non_streaming_mode: bool | None = None
    ref_audio: str | None = Field(
        default=None,
        min_length=1,
        description="A clip of the voice to clone (a Base model): a data: URL or base64; an http(s) "
        "URL where the gateway fetches media (spec.gateway.media.fetchUrls).",
    )
    ref_text: str | None = Field(
        default=None, min_length=1, max_length=4096, description="The clip's transcript: cloning in context."
    )
    x_vector_only_mode: bool | None = None

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, v: Any) -> Any:
        return v.get("id") if isinstance(v, dict) else v

    @field_validator("response_format")
    @classmethod
    def _served_format(cls, v: str) -> str:
        if v not in SPEECH_MEDIA_TYPES:
            raise ValueError(f"'{v}' is not served here; use {' or '.join(SPEECH_MEDIA_TYPES)}")
        return v


DOWNSTREAM: Final = params("speed")
"""What a speech request asks of the stages downstream of its source (a vocoder's speed): not
the source's to honour. Every other field is: the source stage must declare it honours it."""


def speech_request(req: SpeechRequest) -> PipelineRequest:
    """What `POST /v1/audio/speech` (and its socket, per piece) asks of the pipeline."""
    audio = frozenset({OutputKind.AUDIO})
    return PipelineRequest(
        req.model,
        audio,
        speech_inputs(req),
        speech_sampling(req),
        voice_param="voice",
        max_tokens_param="max_new_tokens",
        declared=EVERY_ENGINE | DOWNSTREAM,
        ref_audio=req.ref_audio,
    )


def speech_inputs(req: SpeechRequest) -> RequestInputs:
    """The text to speak is the source stage's prompt (no chat template: nothing to answer)."""
    return RequestInputs(modalities=[OutputKind.AUDIO.value], prompt=req.input, voice=req.voice)


def speech_sampling(req: SpeechRequest) -> Sampling:
    """What the stages get: an engine that does not honour one of these is a 400 naming it."""
    return Sampling(
        voice=req.voice,
        speed=req.speed if req.speed != 1.0 else None,
        instructions=req.instructions or None,
        language=req.language,
        task_type=req.task_type,
        max_tokens=req.max_new_tokens,
        non_streaming_mode=req.non_streaming_mode,
        ref_text=req.ref_text,
        x_vector_only_mode=req.x_vector_only_mode,
    )
