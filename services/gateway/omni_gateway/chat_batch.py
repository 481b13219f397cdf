"""`POST /v1/chat/completions/batch`: vLLM's batch of conversations in one call.

The body is a chat completion's, but `messages` is a list of 1 to 32 conversations (each a
list of messages); the answer is one chat completion with one choice per conversation, choice
`i` for conversation `i`, and the usage of them all. As vLLM's: no `stream`, no `tools`, `n` 1.
Each conversation runs as its own `POST /v1/chat/completions` (omni_gateway.internal: the same
checks and errors), all at once, so the stages batch them as they batch concurrent requests. A
conversation the endpoint refuses or fails makes the whole answer that error, as vLLM's does;
a client that leaves before the answer aborts every conversation still running.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omni_gateway.errors import BadRequest
from omni_gateway.internal import internal_client
from omni_gateway.protocol.common import json_object
from omni_gateway.routes import until_disconnect

router = APIRouter()

MAX_CONVERSATIONS: Final = 32
_OFF: Final = {"stream": (None, False), "n": (None, 1), "tools": (None,), "use_beam_search": (None, False)}
"""What vLLM's batch endpoint does not take, and the values that leave it off."""


@router.post("/v1/chat/completions/batch")
async def chat_completions_batch(request: Request) -> JSONResponse:
    body = await json_object(request)
    conversations = body.get("messages")
    if (
        not isinstance(conversations, list)
        or not 1 <= len(conversations) <= MAX_CONVERSATIONS
        or not all(isinstance(c, list) and c for c in conversations)
    ):
        msg = f"messages: 1 to {MAX_CONVERSATIONS} conversations, each a non-empty list of messages"
        raise BadRequest(msg, param="messages")
    for name, off in _OFF.items():
        if body.get(name) not in off:
            raise BadRequest(f"{name}: not taken by /v1/chat/completions/batch (as vLLM's)", param=name)

    async def every_conversation() -> list[Any]:
        async with internal_client(request.app) as client, asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(client.post("/v1/chat/completions", json={**body, "messages": c}))
                for c in conversations
            ]
        return [t.result() for t in tasks]

    answers = await until_disconnect(every_conversation(), request)
    if (failed := next((a for a in answers if not a.is_success), None)) is not None:
        return JSONResponse(failed.json(), status_code=failed.status_code)
    completions = [a.json() for a in answers]
    usage = {
        k: sum(c["usage"][k] for c in completions if c.get("usage"))
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    choices = [{**c["choices"][0], "index": i} for i, c in enumerate(completions)]
    return JSONResponse({**completions[0], "choices": choices, "usage": usage})
