"""POST /tokenize and /detokenize: vLLM's request models (its benchmark and its users' tools
count tokens with them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_gateway.protocol.chat import ChatMessage, TextPart, Tool
from omni_gateway.protocol.vllm import TokenId
from omni_pipeline.control import RequestInputs, TokenizeMsg
from omni_pipeline.sampling import Sampling


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

    def message(self) -> TokenizeMsg:
        """What the source stage tokenizes, and how (omni_stage.tokenize)."""
        special = self.add_special_tokens if self.add_special_tokens is not None else self.prompt is not None
        if self.messages is None:
            return TokenizeMsg(RequestInputs(prompt=self.prompt), special, self.return_token_strs)
        messages = [
            m.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
            for m in self.messages
        ]
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        template = Sampling(
            chat_template_kwargs=self.chat_template_kwargs or None,
            add_generation_prompt=False if not self.add_generation_prompt else None,
            continue_final_message=True if self.continue_final_message else None,
        )
        return TokenizeMsg(
            RequestInputs(messages=messages, tools=tools), special, self.return_token_strs, template
        )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
