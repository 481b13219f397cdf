"""POST /v1/audio/voices, DELETE /v1/audio/voices/{name}, as vLLM-Omni shapes them; GET
/v1/audio/voices lists these with the model's own (omni_gateway.routes).

An upload is a multipart form: `audio_sample` (a clip: WAV, FLAC or MP3), `name`, `consent` (the
consent recording's id: required, kept with the voice), and optionally `ref_text` (the clip's
transcript: the voice is then cloned in context) and `speaker_description`. The clip is checked
here (not audio, too long, too short, silent, too many bytes: a 400 naming `audio_sample`), then
the pipeline's cloning stage takes the voice from it once (omni_gateway.cloning) and the print
is kept (voices/store.py); the clip itself is not. A name taken (by a model's voice or an
upload) is a 409.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Final

import numpy as np
from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from omni_gateway.errors import BadRequest, Conflict, ModelNotFound, NotFound
from omni_gateway.media import decode_audio
from omni_gateway.voices.store import UploadedVoice, VoiceExists, VoicesFull
from omni_gateway.voices.voices import Voices

router = APIRouter()

NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FIELDS: Final = {"name": 64, "consent": 256, "ref_text": 4096, "speaker_description": 1024}
"""The form's fields, and the most characters each may hold."""
SILENCE: Final = 1e-3
"""A clip whose loudest sample is under this (of full scale) holds no voice."""


def voices_of(request: Request) -> Voices:
    voices: Voices | None = request.app.state.voices
    if voices is None:
        name = request.app.state.pipeline.spec.served_model_name
        raise ModelNotFound(f"model '{name}' does not output audio")
    return voices


async def _form(request: Request, max_bytes: int) -> tuple[dict[str, str], bytes, str]:
    """The form's fields, and the clip's bytes and content type."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("send the voice as a multipart form (audio_sample, name, consent)")
    fields: dict[str, str] = {}
    clip: bytes | None = None
    kind = "application/octet-stream"
    async with request.form(max_files=1) as form:
        for key, value in form.multi_items():
            if key == "audio_sample":
                if not isinstance(value, UploadFile):
                    raise BadRequest("audio_sample: must be a file", param="audio_sample")
                clip, kind = await value.read(max_bytes + 1), value.content_type or kind
            elif key not in FIELDS:  # (vLLM-Omni's speaker_embedding among them: voices come from clips)
                raise BadRequest(f"{key}: unrecognized field", param=key)
            elif isinstance(value, UploadFile):
                raise BadRequest(f"{key}: must be a form field, not a file", param=key)
            elif len(value := value.strip()) > FIELDS[key]:
                raise BadRequest(f"{key}: more than {FIELDS[key]} characters", param=key)
            else:
                fields[key] = value
    if clip is None:
        raise BadRequest("audio_sample: a voice is taken from a clip: send one", param="audio_sample")
    if len(clip) > max_bytes:
        raise BadRequest(f"audio_sample: more bytes than the limit of {max_bytes}", param="audio_sample")
    return fields, clip, kind


@router.post("/v1/audio/voices")
async def upload_voice(request: Request) -> dict[str, Any]:
    voices = voices_of(request)
    spec = voices.spec
    fields, data, kind = await _form(request, spec.max_clip_bytes)
    name = fields.get("name", "")
    if not NAME.fullmatch(name):
        raise BadRequest(
            "name: 1 to 64 letters, digits, '_', '-' or '.', starting with a letter or digit", param="name"
        )
    if not (consent := fields.get("consent", "")):
        raise BadRequest("consent: a voice is kept only with its speaker's consent: its id", param="consent")
    await voices.check_free(name)
    try:
        pcm, rate = await asyncio.to_thread(decode_audio, data, None, spec.max_clip_s)
    except ValueError as exc:
        raise BadRequest(f"audio_sample: {exc}", param="audio_sample") from None
    seconds = len(pcm) / rate
    if seconds < spec.min_clip_s:
        raise BadRequest(
            f"audio_sample: {seconds:.2f} s of audio, under the {spec.min_clip_s:g} s a voice is taken from",
            param="audio_sample",
        )
    if float(np.abs(pcm.numpy()).max()) < SILENCE:
        raise BadRequest("audio_sample: the clip is silent", param="audio_sample")
    ref_text = fields.get("ref_text") or None
    voice = UploadedVoice(
        name=name,
        consent=consent,
        created_at=int(time.time()),
        mime_type=kind,
        file_size=len(data),
        seconds=round(seconds, 3),
        voice=await voices.pipeline.clone_voice(pcm, rate, ref_text),
        speaker_description=fields.get("speaker_description") or None,
    )
    try:
        await voices.store.add(voice, spec.max_voices)
    except VoiceExists:
        raise Conflict(f"name: a voice named '{name}' exists; delete it first", param="name") from None
    except VoicesFull:
        full = f"name: this server keeps {spec.max_voices} voices at most; delete one first"
        raise BadRequest(full, param="name") from None
    shown = {k: v for k, v in voice.listing().items() if k not in ("embedding_source", "embedding_dim")}
    return {"success": True, "voice": shown}


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request) -> dict[str, Any]:
    if not await voices_of(request).store.delete(name):
        raise NotFound(f"voice '{name}' does not exist", param="name")
    return {"success": True, "message": f"Voice '{name}' deleted successfully"}
