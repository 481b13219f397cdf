"""From a client request to prompt token ids: one path for every engine that owns a tokenizer,
so two engines given the same model and request see the same tokens."""

from __future__ import annotations

from typing import Any

from omni_stage.engines.base import InvalidRequest


def messages_to_chat(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI messages -> plain {role, content} text turns; a media part is the client's error."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequest(
                        f"this model takes text only; it cannot read the '{part.get('type')}' part"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        out.append({"role": str(m.get("role", "user")), "content": "" if content is None else str(content)})
    return out


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """A prompt and reply that do not fit the model's positions are the client's error."""
    if prompt_tokens + max_tokens > context:
        raise InvalidRequest(
            f"this model's context is {context} tokens: the prompt is {prompt_tokens} tokens and "
            f"max_tokens asks for {max_tokens} more"
        )


def prompt_token_ids(tokenizer: Any, request: dict[str, Any]) -> list[int]:
    """The request's `messages` through the tokenizer's chat template, or its raw `prompt`."""
    if "messages" in request:
        text = tokenizer.apply_chat_template(
            messages_to_chat(request["messages"]), add_generation_prompt=True, tokenize=False
        )
    else:
        text = str(request.get("prompt", ""))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:  # text the tokenizer drops whole (control characters): nothing to go on from
        raise InvalidRequest("the prompt is empty once tokenized: there is nothing to continue from")
    return ids
