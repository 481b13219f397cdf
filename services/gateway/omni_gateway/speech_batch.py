"""`POST /v1/audio/speech/batch`: vLLM-Omni's batch of speech requests in one call.

1 to 32 items, each a speech request whose fields left out are the batch's (its top-level
fields are the defaults, an item's own win). The items run at once through the pipeline API,
each as `POST /v1/audio/speech` would run it, so the stages batch them as they batch concurrent
requests. The answer lists every item in order, each its audio (base64, in the format asked)
or its own error: one item's failure (a voice the model lacks, a stage that failed) is its own,
never the batch's. The batch as a whole is refused only for what is wrong with it whole (no
items, too many, an unknown field, another model's name). A client that leaves before the answer
aborts every item still running.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Any, Final

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_gateway.audio import to_pcm16, wav_bytes
from omni_gateway.errors import ModelNotFound, OmniError
from omni_gateway.events import AudioChunk, Finished
from omni_gateway.pipeline import Pipeline
from omni_gateway.protocol.speech import SPEECH_MEDIA_TYPES, SpeechRequest
from omni_gateway.realtime.protocol import PCM_RATE, new_id
from omni_gateway.routes import until_disconnect
from omni_gateway.speech import speech_usage
from omni_gateway.voices.voices import Voices, speech_asked

router = APIRouter()

MAX_ITEMS: Final = 32


class _Overrides(BaseModel):
    """The speech fields an item may set and the batch may default."""

    model_config = ConfigDict(extra="forbid")
    voice: str | None = None
    instructions: str | None = None
    response_format: str | None = None
    speed: float | None = None
    language: str | None = None
    task_type: str | None = None
    max_new_tokens: int | None = None
    non_streaming_mode: bool | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None


class SpeechBatchItem(_Overrides):
    """One item: its text, and any field it sets over the batch's."""

    input: str


class SpeechBatchRequest(_Overrides):
    """The batch: its items, and the defaults of their fields."""

    model: str | None = None
    items: list[SpeechBatchItem] = Field(min_length=1, max_length=MAX_ITEMS)

    def item_fields(self, item: SpeechBatchItem) -> dict[str, Any]:
        """The item's speech request: its own fields over the batch's, those left unset out."""
        fields: dict[str, Any] = {"input": item.input}
        if self.model is not None:
            fields["model"] = self.model
        for name in _Overrides.model_fields:
            value = getattr(item, name)
            if value is None:
                value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return fields


async def _speak(
    pipeline: Pipeline, voices: Voices | None, index: int, fields: dict[str, Any]
) -> dict[str, Any]:
    """One item, whole: its result entry."""
    try:
        req = SpeechRequest(**{"model": pipeline.spec.served_model_name, **fields})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return {"index": index, "status": "error", "error": f"{where}: {first['msg']}"}
    try:
        prepared = await pipeline.prepare(await speech_asked(voices, req))
        pcm: list[bytes] = []
        rate, finished = PCM_RATE, None
        async with contextlib.aclosing(pipeline.run(new_id("tts").replace("_", "-"), prepared)) as events:
            async for ev in events:
                if isinstance(ev, AudioChunk):
                    rate = ev.sample_rate
                    pcm.append(to_pcm16(ev.samples))
                elif isinstance(ev, Finished):
                    finished = ev
    except OmniError as exc:
        return {"index": index, "status": "error", "error": exc.message}
    body = b"".join(pcm)
    data = wav_bytes(body, rate) if req.response_format == "wav" else body
    return {
        "index": index,
        "status": "success",
        "audio_data": base64.b64encode(data).decode(),
        "media_type": SPEECH_MEDIA_TYPES[req.response_format],
        "usage": None if finished is None else speech_usage(finished),
    }


@router.post("/v1/audio/speech/batch")
async def speech_batch(req: SpeechBatchRequest, request: Request) -> dict[str, Any]:
    pipeline: Pipeline = request.app.state.pipeline
    voices: Voices | None = request.app.state.voices
    if req.model is not None and req.model != pipeline.spec.served_model_name:
        raise ModelNotFound(f"model '{req.model}' does not exist", param="model")

    async def every_item() -> list[dict[str, Any]]:
        # A task group: should one item's task fail unexpectedly, the others are cancelled
        # (their requests aborted) rather than left running unowned.
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_speak(pipeline, voices, i, req.item_fields(it)))
                for i, it in enumerate(req.items)
            ]
        return [t.result() for t in tasks]

    results = await until_disconnect(every_item(), request)  # a client that leaves aborts them all
    succeeded = sum(r["status"] == "success" for r in results)
    return {
        "id": new_id("speechbatch"),
        "results": results,
        "total": len(results),
        "succeeded": succeeded,
        "failed": len(results) - succeeded,
    }
