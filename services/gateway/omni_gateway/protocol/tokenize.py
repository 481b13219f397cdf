"""POST /tokenize and /detokenize: vLLM's request models (its benchmark and its users' tools
count tokens with them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_gateway.protocol.chat import ChatMessage, TextPart, Tool
from omni_gateway.protocol.vllm import TokenId
from omni_pipeline.control import RequestInputs


class TokenizeRequest(BaseModel):
    """vLLM's two /tokenize bodies in one: a `prompt` (special tokens added by default), or
    chat `messages` as the chat template lays them out (none added by default; text parts
    only: a media part's tokens depend on the media, which this endpoint does not read)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = Field(
        default=None, description="Default: true for a prompt, false for messages."
    )
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send `prompt` or `messages`, one of them")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "`continue_final_message` and `add_generation_prompt` cannot both be true "
                "(send add_generation_prompt: false)"
            )
        for i, m in enumerate(self.messages or []):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if not isinstance(part, TextPart):
                    raise ValueError(f"messages[{i}].content[{j}]: /tokenize counts text parts only")
        return self

    def inputs(self) -> tuple[RequestInputs, dict[str, Any]]:
        """What the source stage tokenizes, and how (omni_stage.tokenize)."""
        options: dict[str, Any] = {
            "add_special_tokens": self.add_special_tokens
            if self.add_special_tokens is not None
            else self.prompt is not None,
            "return_token_strs": self.return_token_strs,
        }
        if self.messages is None:
            return RequestInputs(prompt=self.prompt), options
        messages = [
            m.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
            for m in self.messages
        ]
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        options["chat_template_kwargs"] = self.chat_template_kwargs or {}
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        return RequestInputs(messages=messages, tools=tools), options


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
