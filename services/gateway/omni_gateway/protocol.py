"""HTTP models of the OpenAI-compatible API (pydantic), and their conversion to stage inputs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_pipeline.spec import OutputKind


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """Image/audio input parts pass through to the source stage, which decides if it takes them."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | MediaPart] | None = None
    name: str | None = None


class AudioParams(BaseModel):
    voice: str = Field(min_length=1, max_length=64)
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")

    @model_validator(mode="after")
    def _audio(self) -> ChatCompletionRequest:
        if "audio" in self.wanted_outputs() and self.audio is None:
            raise ValueError("`audio` (voice and format) is required when modalities include 'audio'")
        return self

    def wanted_outputs(self) -> set[OutputKind]:
        return {OutputKind(m) for m in (self.modalities or ["text"])}


def stage_inputs(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the source stages get: messages and output wishes, model-agnostic."""
    out: dict[str, Any] = {
        "messages": [m.model_dump(exclude_none=True) for m in req.messages],
        "modalities": sorted(k.value for k in req.wanted_outputs()),
    }
    if req.audio is not None:
        out["voice"] = req.audio.voice
    return out


def sampling_params(req: ChatCompletionRequest) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_tokens": req.max_completion_tokens or req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
    }
    return {k: v for k, v in params.items() if v is not None}
