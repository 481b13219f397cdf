"""POST /v1/chat/completions: its request model, and what the pipeline gets of it (inputs, sampling)."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from omni_gateway.protocol.common import refuse_unless_off
from omni_gateway.protocol.vllm import (
    GUIDED,
    AllowedTokenIds,
    BadWords,
    Count,
    StageSampling,
    StopTokenIds,
    StructuredOutputs,
)
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(min_length=1, description="A data: URL, or http(s) where the gateway fetches URLs.")
    detail: Literal["auto"] = Field(
        default="auto", description="Only `auto`: the model's own processor picks the resolution."
    )


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str = Field(description="Base64 of the whole file.")
    format: str = Field(description="wav, flac or mp3.")


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoURL(BaseModel):
    url: str = Field(min_length=1, description="A data: URL, or http(s) where the gateway fetches URLs.")


class VideoPart(BaseModel):
    """A video, as vLLM's and vLLM-Omni's chat APIs take it (OpenAI's has none)."""

    type: Literal["video_url"]
    video_url: VideoURL


class OtherPart(BaseModel):
    """Parts OpenAI defines that this server does not take (files): a 400 naming the part, from
    the media decoder, rather than a schema error listing every part type."""

    model_config = ConfigDict(extra="allow")
    type: Literal["file", "input_video", "refusal"]


ContentPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart | OtherPart, Field(discriminator="type")]


_MESSAGE_OFF: Final[dict[str, tuple[Any, ...]]] = {
    "function_call": (),
    "audio": (),
    "refusal": (),
}
"""What an assistant turn a client sends back may carry, only as null: the parts of a reply
this server never makes (a reference to earlier audio, a refusal, the old function_call)."""


class CalledFunction(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCallMade(BaseModel):
    """A call an earlier assistant turn made, as the client sends the conversation back."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    annotations: list[Any] | None = Field(default=None, description="Accepted and ignored (web citations).")
    tool_calls: list[ToolCallMade] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None

    @field_validator(*_MESSAGE_OFF, mode="before")
    @classmethod
    def _not_served(cls, v: Any, info: ValidationInfo) -> None:
        refuse_unless_off(v, info, _MESSAGE_OFF)


class AudioParams(BaseModel):
    voice: str = Field(min_length=1, max_length=64)
    format: Literal["wav", "pcm16"] = "wav"


MAX_CHOICES: Final = 16
"""Most replies (`n`) one chat request may ask for: each is a request through the pipeline."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="vLLM's: with include_usage, every chunk carries its reply's usage so far."
    )
    include_obfuscation: bool | None = Field(default=None, description="Accepted and ignored (no padding).")


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(
        default=None,
        description="Not served: the grammar holds the reply to the schema; refused unless empty.",
    )
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(default=None, description="Either way the reply follows the schema.")

    @field_validator("description")
    @classmethod
    def _no_description(cls, v: str | None) -> None:
        if v:
            raise ValueError(
                "not served: the reply is held to the schema, and no model here reads its description"
            )


class ResponseFormat(BaseModel):
    """`text`; `json_object`: some JSON object; `json_schema`: JSON valid against its schema.
    Both JSON kinds constrain decoding to a grammar (where the engine honours them)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` goes with, and only with, type 'json_schema'")
        return self

    def sampling(self) -> dict[str, Any] | None:
        """What the engines get: None for text."""
        if self.type == "text":
            return None
        if self.json_schema is None:
            return {"type": self.type}
        return {"type": self.type, "schema": self.json_schema.json_schema or {}}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON schema of its arguments.")
    strict: bool | None = Field(default=None, description="Either way the arguments follow the schema.")


class Tool(BaseModel):
    """A function the model may call (OpenAI's `custom` tools are not served: a 400)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


_CHAT_OFF: Final[dict[str, tuple[Any, ...]]] = {
    "functions": ([],),
    "function_call": ("none",),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}
"""OpenAI's chat fields this server does not serve yet, each with the values that mean "off"."""


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Every field is served, refused unless off (`_CHAT_OFF`), or
    one of OpenAI's platform fields, accepted and ignored; an unknown field is a 400. vLLM's
    extensions (its dialect of this API) and vLLM-Omni's own fields are served as theirs are:
    docs/api.md has the table of which engine honours which."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = Field(
        default=None,
        description="Voice and format. Without it (as vLLM-Omni's clients ask) an audio reply is in "
        "the speaking stage's default voice, WAV, streamed as vLLM-Omni streams it.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(default=None, description="Token id (a decimal string) -> bias added to its logit.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    n: int = Field(
        default=1,
        ge=1,
        le=MAX_CHOICES,
        description="Replies, run side by side, each seeded with seed + its index.",
    )
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        default=None, description="With tools: false allows one call at most. Without, no effect."
    )
    # vLLM's extensions: passed on to the engines, which declare what they honour.
    ignore_eos: bool = False
    min_tokens: Count = 0
    top_k: int | None = Field(default=None, ge=-1, lt=2**31, description="-1 or 0: every token.")
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, lt=2**31, description="-1: no truncation."
    )
    allowed_token_ids: AllowedTokenIds | None = None
    bad_words: BadWords | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    echo: bool = Field(
        default=False,
        description="The last message's text starts the reply, where it is the reply's own role.",
    )
    request_id: str | None = Field(
        default=None, min_length=1, max_length=256, description="The response's id."
    )
    priority: int = Field(
        default=0,
        ge=-(2**31),
        lt=2**31,
        description="vLLM's: a replica starts its waiting requests the lower value first, then in order.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="The prompt's log probabilities, with this many likeliest others.",
    )
    # vLLM-Omni's own.
    return_stage_metrics: bool = Field(
        default=False, description="Per-stage figures in `metrics`, as vLLM-Omni's."
    )
    sampling_params_list: list[StageSampling | None] | None = Field(
        default=None, description="Sampling per stage, in the pipeline's stage order (null: the stage's own)."
    )
    prompt_cache_key: str | None = Field(
        default=None,
        max_length=64,
        description="A conversation's name: its turns reuse the sequence the replica kept of the last.",
    )
    # OpenAI's platform, not the model's: accepted and ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    # Not served yet: refused unless off.
    functions: list[Any] | None = None
    function_call: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None

    @field_validator(*_CHAT_OFF, mode="before")
    @classmethod
    def _not_served(cls, v: Any, info: ValidationInfo) -> None:
        refuse_unless_off(v, info, _CHAT_OFF)

    @model_validator(mode="after")
    def _vllm(self) -> ChatCompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("`prompt_logprobs` are not available when `stream` is true (as in vLLM)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "`continue_final_message` and `add_generation_prompt` cannot both be true "
                "(send add_generation_prompt: false)"
            )
        grammars = [name for name in GUIDED if getattr(self, name) is not None]
        grammars += ["structured_outputs"] if self.structured_outputs is not None else []
        grammars += (
            ["response_format"] if self.response_format and self.response_format.type != "text" else []
        )
        if len(grammars) > 1:
            raise ValueError(f"{' and '.join(f'`{g}`' for g in grammars)} together: ask for one grammar")
        if self.structured_outputs is not None and self.calls_tools():
            raise ValueError("`tools` and `structured_outputs` together: ask for one")
        return self

    def prompt_logprobs_asked(self) -> int | None:
        """`prompt_logprobs`; or as vLLM reads `echo` with `top_logprobs`, that many (not for a
        stream, which cannot carry them)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.top_logprobs if self.echo and not self.stream else None

    def structured(self) -> dict[str, Any] | None:
        """`structured_outputs`, or the guided_* field that stands for it, as the engines take it."""
        if self.structured_outputs is not None:
            return self.structured_outputs.asked()
        for name, kind in GUIDED.items():
            if (v := getattr(self, name)) is not None:
                return {kind: v}
        return None

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("`tool_choice` other than none or auto needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in self.tools or []
        }:
            raise ValueError(f"`tool_choice` names '{choice.function.name}', which is not in `tools`")
        if self.calls_tools() and "audio" in self.wanted_outputs():
            raise ValueError("`tools` with an audio reply: a spoken reply cannot carry tool calls")
        if self.calls_tools() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("`tools` and a JSON `response_format` together: ask for one")
        return self

    def calls_tools(self) -> bool:
        """The model may call a tool (OpenAI's default with tools is `auto`)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs `logprobs: true`")
        return v

    def wanted_outputs(self) -> set[OutputKind]:
        return {OutputKind(m) for m in (self.modalities or ["text"])}


def stage_inputs(req: ChatCompletionRequest) -> RequestInputs:
    """What the source stages get: messages and output wishes, model-agnostic."""
    return RequestInputs(
        modalities=sorted(k.value for k in req.wanted_outputs()),
        messages=[
            m.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
            for m in req.messages
        ],
        voice=req.audio.voice if req.audio is not None else None,
        # For the chat template, whether or not the model may call them.
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
    )


def _dump(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


def sampling_params(req: ChatCompletionRequest) -> Sampling:
    """The request's sampling parameters that are set, each away from its "off" value."""
    params: dict[str, Any] = {
        "max_tokens": req.max_completion_tokens or req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stop": ([req.stop] if isinstance(req.stop, str) else req.stop) or None,
        "frequency_penalty": req.frequency_penalty or None,
        "presence_penalty": req.presence_penalty or None,
        "logit_bias": req.logit_bias or None,
        "logprobs": req.logprobs or None,
        "top_logprobs": req.top_logprobs if req.logprobs else None,
        "response_format": req.response_format.sampling() if req.response_format else None,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []] if req.calls_tools() else None,
        "tool_choice": _dump(req.tool_choice) if req.calls_tools() else None,
        "parallel_tool_calls": req.parallel_tool_calls if req.calls_tools() else None,
        # Also a request parameter, not only an input: the stages that speak (a talker, a
        # code2wav) read it downstream of the source stage.
        "voice": req.audio.voice if req.audio is not None else None,
        # vLLM's extensions, each away from its "off" value.
        "ignore_eos": req.ignore_eos or None,
        "min_tokens": req.min_tokens or None,
        "top_k": req.top_k if req.top_k not in (None, 0, -1) else None,
        "min_p": req.min_p or None,
        "repetition_penalty": req.repetition_penalty if req.repetition_penalty not in (None, 1.0) else None,
        "stop_token_ids": req.stop_token_ids or None,
        "include_stop_str_in_output": req.include_stop_str_in_output or None,
        "skip_special_tokens": False if not req.skip_special_tokens else None,
        "spaces_between_special_tokens": False if not req.spaces_between_special_tokens else None,
        "truncate_prompt_tokens": req.truncate_prompt_tokens if req.truncate_prompt_tokens != -1 else None,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words or None,
        "add_generation_prompt": False if not req.add_generation_prompt else None,
        "continue_final_message": req.continue_final_message or None,
        "chat_template_kwargs": req.chat_template_kwargs or None,
        "mm_processor_kwargs": req.mm_processor_kwargs or None,
        "prompt_logprobs": req.prompt_logprobs_asked(),
        "structured_outputs": req.structured(),
        "prompt_cache_key": req.prompt_cache_key,
    }
    return Sampling(**{k: v for k, v in params.items() if v is not None})


def stage_sampling(req: ChatCompletionRequest, stages: list[str]) -> dict[str, Sampling]:
    """vLLM-Omni's `sampling_params_list`, by stage name: entry i is the pipeline's stage i
    (`stages`, in order); a null entry leaves that stage as it is. ValueError for more entries
    than stages."""
    if req.sampling_params_list is None:
        return {}
    if len(req.sampling_params_list) > len(stages):
        raise ValueError(
            f"{len(req.sampling_params_list)} entries for {len(stages)} stages ({', '.join(stages)})"
        )
    return {stages[i]: p.sampling() for i, p in enumerate(req.sampling_params_list) if p is not None}
