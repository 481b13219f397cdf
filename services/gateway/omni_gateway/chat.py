"""Chat completions: pipeline events -> OpenAI responses, whole or as SSE chunks."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omni_gateway.audio import to_pcm16, wav_bytes
from omni_gateway.errors import OmniError, error_from
from omni_gateway.events import AudioChunk, Event, Finished, OfChoice, TextDelta
from omni_gateway.protocol.chat import ChatCompletionRequest, TextPart
from omni_pipeline.control import PromptLogprob, TokenLogprob, ToolCall

AUDIO_TTL_S = 3600


class ChatResult:
    """Accumulates one request's events into a non-streaming response."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tool_calls: dict[str, ToolCall] = {}
        """By id: a call streamed in fragments is one call."""
        self.audio: list[np.ndarray] = []
        self.sample_rate = 24000
        self.finished = Finished("stop", {})

    def add(self, ev: Event) -> None:
        if isinstance(ev, TextDelta):
            self.text.append(ev.text)
            self.logprobs += ev.logprobs
            for c in ev.tool_calls:
                had = self.tool_calls.get(c.id)
                self.tool_calls[c.id] = (
                    c if had is None else ToolCall(c.id, c.name, had.arguments + c.arguments)
                )
        elif isinstance(ev, AudioChunk):
            self.audio.append(ev.samples)
            self.sample_rate = ev.sample_rate
        else:
            self.finished = ev


def index_of(ev: Event | OfChoice) -> tuple[int, Event]:
    """Which reply an event is of (a request with `n` 1 has only reply 0), and the event."""
    return (ev.index, ev.event) if isinstance(ev, OfChoice) else (0, ev)


def response_id(req: ChatCompletionRequest, rid: str) -> str:
    """The response's id: vLLM's `request_id` where the client set one."""
    return f"chatcmpl-{req.request_id or rid}"


def echoed(req: ChatCompletionRequest) -> str:
    """What vLLM's `echo` puts before the reply: the last message's text, where that message
    is in the reply's own role (the assistant's, unless `add_generation_prompt` is false: then
    the last message's, whose turn the reply goes on)."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if not req.echo or last.role != role:
        return ""
    if isinstance(last.content, list):
        return "".join(p.text for p in last.content if isinstance(p, TextPart))
    return last.content or ""


def stage_metrics(req: ChatCompletionRequest, finished: Finished) -> dict[str, Any] | None:
    """vLLM-Omni's `metrics` (with `return_stage_metrics`): per stage, by its index in the
    pipeline, what it read and made and when its output reached the gateway."""
    if not req.return_stage_metrics:
        return None
    return {
        "stage_metrics": {
            str(f.index): {
                "stage_id": f.index,
                "stage": name,
                "final_output_type": f.final_output,
                "finish_reason": finished.finish_reason if f.final_output == "text" else None,
                "num_tokens_in": f.units_in,
                "num_tokens_out": f.units_out,
                "stage_gen_time_ms": f.done_ms,
                "serving_time_to_first_output_ms": f.first_output_ms or 0.0,
            }
            for name, f in finished.stages.items()
        }
    }


def completion_body(
    req: ChatCompletionRequest, rid: str, created: int, results: list[ChatResult]
) -> dict[str, Any]:
    body = {
        "id": response_id(req, rid),
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": [
            {
                "index": i,
                "message": _message(req, f"{rid}.{i}" if len(results) > 1 else rid, created, r),
                "finish_reason": r.finished.finish_reason,
                "logprobs": choice_logprobs(req, r.logprobs),
            }
            for i, r in enumerate(results)
        ],
        "usage": _usage([r.finished.usage for r in results]),
    }
    if (metrics := stage_metrics(req, results[0].finished)) is not None:
        body["metrics"] = metrics
    if (prompt := results[0].finished.prompt_logprobs) is not None:
        body["prompt_logprobs"] = [
            None if at is None else {str(p.token_id): _prompt_logprob(p) for p in at} for at in prompt
        ]
    return body


def _prompt_logprob(p: PromptLogprob) -> dict[str, Any]:
    """vLLM's Logprob, with -inf clamped as vLLM clamps it (JSON has no infinity)."""
    return {"logprob": max(p.logprob, -9999.0), "rank": p.rank, "decoded_token": p.token}


def _message(req: ChatCompletionRequest, rid: str, created: int, r: ChatResult) -> dict[str, Any]:
    text = echoed(req) + "".join(r.text)
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if r.tool_calls:
        message["content"] = text or None
        message["tool_calls"] = [_tool_call(c) for c in r.tool_calls.values()]
    if "audio" in (req.modalities or []):
        pcm = to_pcm16(np.concatenate(r.audio) if r.audio else np.zeros(0, np.float32))
        data = pcm if req.audio is not None and req.audio.format == "pcm16" else wav_bytes(pcm, r.sample_rate)
        message["audio"] = {
            "id": f"audio_{rid}",
            "data": base64.b64encode(data).decode(),
            "expires_at": created + AUDIO_TTL_S,
            "transcript": text,
        }
    return message


def _usage(each: list[dict[str, int]]) -> dict[str, Any]:
    """One prompt, read by every reply: counted once, as OpenAI counts it; the replies' tokens
    summed. Of the prompt, those a kept sequence held (`prompt_cache_key`) in its details."""
    prompt = each[0].get("prompt_tokens", 0)
    completion = sum(u.get("completion_tokens", 0) for u in each)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached := max(u.get("cached_tokens", 0) for u in each):
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def choice_logprobs(req: ChatCompletionRequest, tokens: list[TokenLogprob]) -> dict[str, Any] | None:
    """OpenAI's `choices[].logprobs`, where the request asked for them."""
    if not req.logprobs:
        return None
    return {
        "content": [
            _token(t.token, t.logprob) | {"top_logprobs": [_token(*a) for a in t.top]} for t in tokens
        ],
        "refusal": None,
    }


def _tool_call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _tool_call_delta(c: ToolCall, calls: dict[str, int]) -> dict[str, Any]:
    """A call's fragment as a stream chunk's: its first names it, later ones extend its
    arguments (`calls`: the reply's calls so far, id -> index)."""
    if c.id in calls:
        return {"index": calls[c.id], "function": {"arguments": c.arguments}}
    calls[c.id] = len(calls)
    return {"index": calls[c.id], **_tool_call(c)}


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_chunks(
    req: ChatCompletionRequest,
    rid: str,
    created: int,
    first: Event | OfChoice,
    events: AsyncIterator[Event] | AsyncIterator[OfChoice],
) -> AsyncIterator[str]:
    """SSE: a role chunk per reply, text and audio deltas as they come (the `n` replies'
    interleaved, each chunk naming its reply's index), a finish chunk per reply, usage once
    every reply has ended, [DONE].

    Every chunk also says its `modality` (`text` or `audio`), as vLLM-Omni's do. Audio comes in
    one of two shapes. A request that names `audio` (OpenAI's clients must) gets OpenAI's:
    `delta.audio`, with raw PCM16 for format `pcm16` (the chunks concatenate into one stream)
    and for `wav` a whole WAV file per chunk (each decodes on its own, as vLLM-Omni streams
    them and as its clients read them). One that asks for audio without naming `audio`
    (vLLM-Omni's clients) gets vLLM-Omni's: a whole WAV file per chunk, base64 in
    `delta.content`. With `stream_options.continuous_usage_stats` (and `include_usage`, as in
    vLLM) every chunk carries its reply's usage so far; with `return_stage_metrics` each
    reply's finish chunk carries vLLM-Omni's `metrics`. vLLM's `echo` comes first, as a text
    delta. A failure mid-stream becomes an error event; `[DONE]` always ends the stream.
    """
    base = {
        "id": response_id(req, rid),
        "object": "chat.completion.chunk",
        "created": created,
        "model": req.model,
    }
    options = req.stream_options
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    so_far = [_usage([{}]) for _ in range(req.n)]
    modality = ["text"] * req.n

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        body = {**base, "choices": [choice], "modality": modality[index]}
        body |= {"usage": so_far[index]} if continuous else {}
        return _sse(body | {"metrics": metrics} if metrics is not None else body)

    wav_chunks = req.audio is None or req.audio.format == "wav"
    usage: list[dict[str, int]] = []
    calls: list[dict[str, int]] = [{} for _ in range(req.n)]
    echo = echoed(req)
    for i in range(req.n):
        yield chunk(i, {"role": "assistant", "content": ""})
        if echo:
            yield chunk(i, {"content": echo})
    try:
        item: Event | OfChoice | None = first
        while item is not None:
            i, ev = index_of(item)
            if isinstance(ev, TextDelta):
                modality[i] = "text"
                if ev.usage is not None:
                    so_far[i] = _usage([ev.usage])
                if ev.text or ev.logprobs:
                    yield chunk(i, {"content": ev.text}, logprobs=choice_logprobs(req, ev.logprobs))
                if ev.tool_calls:
                    yield chunk(i, {"tool_calls": [_tool_call_delta(c, calls[i]) for c in ev.tool_calls]})
            elif isinstance(ev, AudioChunk):
                modality[i] = "audio"
                data = to_pcm16(ev.samples)
                if wav_chunks:
                    data = wav_bytes(data, ev.sample_rate)
                if req.audio is None:
                    yield chunk(i, {"content": base64.b64encode(data).decode()})
                else:
                    yield chunk(i, {"audio": _audio_delta(rid, i, req.n, created, data)})
            elif isinstance(ev, Finished):
                so_far[i] = _usage([ev.usage])
                yield chunk(i, {}, ev.finish_reason, metrics=stage_metrics(req, ev))
                usage.append(ev.usage)
                if len(usage) == req.n and options and options.include_usage:
                    total = {**base, "choices": [], "modality": "text", "usage": _usage(usage)}
                    yield _sse(total)
            item = await anext(events, None)
    except Exception as exc:
        err: OmniError = error_from(exc)
        yield _sse(err.body())
    yield "data: [DONE]\n\n"


def _audio_delta(rid: str, index: int, n: int, created: int, data: bytes) -> dict[str, Any]:
    """OpenAI's streamed `delta.audio`."""
    return {
        "id": f"audio_{rid}.{index}" if n > 1 else f"audio_{rid}",
        "data": base64.b64encode(data).decode(),
        "expires_at": created + AUDIO_TTL_S,
    }


def now() -> int:
    return int(time.time())
