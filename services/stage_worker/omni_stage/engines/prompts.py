"""From a client request to prompt token ids: one path for every engine that owns a tokenizer,
so two engines given the same model and request see the same tokens."""

from __future__ import annotations

import json
from typing import Any

from omni_pipeline.sampling import EMPTY, Sampling
from omni_stage.engines.base import InvalidRequest


def messages_to_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> {role, content} text turns, with the tool calls an assistant turn made
    and the call a tool turn answers (as chat templates read them: arguments as an object);
    a media part is the client's error."""
    out: list[dict[str, Any]] = []
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
        turn: dict[str, Any] = {
            "role": str(m.get("role", "user")),
            "content": "" if content is None else str(content),
        }
        if calls := m.get("tool_calls"):
            turn["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {**c["function"], "arguments": _arguments(c)},
                }
                for c in calls
            ]
        if "tool_call_id" in m:
            turn["tool_call_id"] = m["tool_call_id"]
        out.append(turn)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "")
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """A prompt and reply that do not fit the model's positions are the client's error."""
    if prompt_tokens + max_tokens > context:
        raise InvalidRequest(
            f"this model's context is {context} tokens: the prompt is {prompt_tokens} tokens and "
            f"max_tokens asks for {max_tokens} more"
        )


def chat_template_args(sampling: Sampling) -> dict[str, Any]:
    """The chat template's arguments a request sets (vLLM's fields): `add_generation_prompt`
    (default true), `continue_final_message` (the reply goes on from the last message, so no
    new turn is opened), and `chat_template_kwargs`, the template's own variables."""
    continue_final = bool(sampling.continue_final_message)
    add_generation = sampling.add_generation_prompt is not False
    if continue_final and sampling.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message: cannot go with add_generation_prompt: true (it opens a new turn)"
        )
    args: dict[str, Any] = dict(sampling.chat_template_kwargs or {})
    args["add_generation_prompt"] = add_generation and not continue_final
    if continue_final:
        args["continue_final_message"] = True
    return args


def prompt_token_ids(tokenizer: Any, request: dict[str, Any], sampling: Sampling = EMPTY) -> list[int]:
    """The request's `messages` through the tokenizer's chat template, or its raw `prompt`; with
    vLLM's `truncate_prompt_tokens`, only the last that many."""
    if "messages" in request:
        try:
            text = tokenizer.apply_chat_template(
                messages_to_chat(request["messages"]),
                tools=request.get("tools") or None,
                tokenize=False,
                **chat_template_args(sampling),
            )
        except ValueError as exc:  # continue_final_message without a final message to continue
            raise InvalidRequest(f"the chat template cannot apply: {exc}") from None
    else:
        text = str(request.get("prompt", ""))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if (keep := sampling.truncate_prompt_tokens) is not None and keep >= 0:
        ids = ids[len(ids) - keep :] if keep < len(ids) else ids
    if not ids:  # text the tokenizer drops whole (control characters): nothing to go on from
        raise InvalidRequest("the prompt is empty once tokenized: there is nothing to continue from")
    return ids
