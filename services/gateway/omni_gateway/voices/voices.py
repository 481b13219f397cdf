"""A gateway's uploaded voices: the store its mode keeps them in, and speech requests that name
one (the voice's print goes with them in place of a clip)."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from pathlib import Path

import msgspec
import nats.errors

from omni_gateway.errors import BadRequest, Conflict, Unavailable
from omni_gateway.pipeline import Pipeline
from omni_gateway.protocol.speech import SpeechRequest, speech_request
from omni_gateway.request import PipelineRequest
from omni_gateway.voices.jetstream_store import JetStreamVoiceStore
from omni_gateway.voices.sqlite_store import SqliteVoiceStore
from omni_gateway.voices.store import UploadedVoice, VoiceStore
from omni_pipeline.settings import VoicesSpec
from omni_pipeline.spec import Mode

log = logging.getLogger("omni.gateway")


class Voices:
    """`store` None: there is nowhere to keep voices (JetStream off on the pipeline's NATS, a
    state directory not writable): the gateway serves all else, lists none and refuses uploads,
    saying why."""

    def __init__(self, pipeline: Pipeline, spec: VoicesSpec, store: VoiceStore | None) -> None:
        self.pipeline, self.spec, self._store = pipeline, spec, store

    @classmethod
    async def open(cls, pipeline: Pipeline, name: str) -> Voices:
        """The voices of pipeline `name`, in the store its mode keeps them in (`store: auto`:
        SQLite in SingleNode, JetStream otherwise)."""
        spec = pipeline.spec.gateway.voices
        kind = spec.store
        if kind == "auto":
            kind = "sqlite" if pipeline.spec.mode is Mode.SINGLE_NODE else "jetstream"
        store: VoiceStore
        try:
            if kind == "sqlite":
                root = Path(spec.state_dir) / name
                store = await SqliteVoiceStore.open(root)
                log.info("voices: kept in SQLite under %s", root)
            else:
                store = await JetStreamVoiceStore.open(pipeline.nats, name)
                log.info("voices: kept in JetStream")
        except (OSError, sqlite3.Error, nats.errors.Error, TimeoutError) as exc:
            # (a state directory not writable, JetStream off): voices alone are refused
            log.warning("voices: none can be kept (store %s): %s", kind, exc)
            return cls(pipeline, spec, None)
        return cls(pipeline, spec, store)

    @property
    def store(self) -> VoiceStore:
        """The store; 503 where there is none (see the class)."""
        if self._store is None:
            raise Unavailable(
                "voices cannot be kept here: the gateway could not open its voice store (with "
                "store jetstream: the pipeline's NATS server has JetStream off, and the chart's "
                "nats.jetstream turns it on; with sqlite: spec.gateway.voices.stateDir is not writable)"
            )
        return self._store

    async def all(self) -> list[UploadedVoice]:
        return [] if self._store is None else await self._store.all()

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
        if self._store is None or (kept := await self._store.get(req.voice)) is None:
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
        if self._store is not None:
            await self._store.close()


async def speech_asked(voices: Voices | None, req: SpeechRequest) -> PipelineRequest:
    """`Voices.speech` where the pipeline speaks (keeps voices); else speech_request."""
    return speech_request(req) if voices is None else await voices.speech(req)
