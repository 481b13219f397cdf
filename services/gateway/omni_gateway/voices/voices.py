"""A gateway's uploaded voices: the store its mode keeps them in, and speech requests that name
one (the voice's print goes with them in place of a clip)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import msgspec

from omni_gateway.errors import BadRequest, Conflict
from omni_gateway.pipeline import Pipeline
from omni_gateway.protocol.speech import SpeechRequest, speech_request
from omni_gateway.request import PipelineRequest
from omni_gateway.voices.jetstream_store import JetStreamVoiceStore
from omni_gateway.voices.sqlite_store import SqliteVoiceStore
from omni_gateway.voices.store import VoiceStore
from omni_pipeline.settings import VoicesSpec
from omni_pipeline.spec import Mode

log = logging.getLogger("omni.gateway")


class Voices:
    def __init__(self, pipeline: Pipeline, spec: VoicesSpec, store: VoiceStore) -> None:
        self.pipeline, self.spec, self.store = pipeline, spec, store

    @classmethod
    async def open(cls, pipeline: Pipeline, name: str) -> Voices:
        """The voices of pipeline `name`, in the store its mode keeps them in (`store: auto`:
        SQLite in SingleNode, JetStream otherwise)."""
        spec = pipeline.spec.gateway.voices
        kind = spec.store
        if kind == "auto":
            kind = "sqlite" if pipeline.spec.mode is Mode.SINGLE_NODE else "jetstream"
        store: VoiceStore
        if kind == "sqlite":
            root = Path(spec.state_dir) / name
            store = await SqliteVoiceStore.open(root)
            log.info("voices: kept in SQLite under %s", root)
        else:
            store = await JetStreamVoiceStore.open(pipeline.nats, name)
            log.info("voices: kept in JetStream")
        return cls(pipeline, spec, store)

    async def check_free(self, name: str) -> None:
        """A 409 for a name a model's voice or an upload has, case aside."""
        spoken = self.pipeline.voices() or frozenset()
        if name.lower() in {v.lower() for v in spoken} or await self.store.get(name) is not None:
            raise Conflict(f"name: a voice named '{name}' exists; choose another", param="name")

    async def speech(self, req: SpeechRequest) -> PipelineRequest:
        """What a speech request asks of the pipeline (speech_request), an uploaded voice that
        `voice` names going as its print."""
        asked = speech_request(req)
        if req.voice is None or req.voice in (self.pipeline.voices() or ()):
            return asked
        if (kept := await self.store.get(req.voice)) is None:
            return asked  # the pipeline's check lists the voices there are
        for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
            if getattr(req, name) is not None:
                raise BadRequest(
                    f"{name}: voice '{req.voice}' was uploaded, and brings its own clip; leave it out",
                    param=name,
                )
        sampling = msgspec.structs.replace(asked.sampling, voice=None, ref_text=kept.voice.ref_text)
        return dataclasses.replace(asked, sampling=sampling, voice_print=kept.voice)

    async def close(self) -> None:
        await self.store.close()


async def speech_asked(voices: Voices | None, req: SpeechRequest) -> PipelineRequest:
    """`Voices.speech` where the pipeline speaks (keeps voices); else speech_request."""
    return speech_request(req) if voices is None else await voices.speech(req)
