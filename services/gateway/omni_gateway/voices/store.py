"""What an uploaded voice is as it is kept, and what every voice store does with it
(sqlite_store.py for `omni serve`, jetstream_store.py for Distributed mode and Kubernetes).

A voice is the server's, not one API key's (as vLLM-Omni keeps them): every client sees and may
speak in every voice, and its consent is recorded with it. Names are unique case aside.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from omni_pipeline.voices import VoicePrint


class UploadedVoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One voice as it is stored; `listing()` is how GET /v1/audio/voices shows it."""

    name: str
    consent: str
    created_at: int
    mime_type: str
    file_size: int
    seconds: float
    voice: VoicePrint
    speaker_description: str | None = None

    @property
    def key(self) -> str:
        return self.name.lower()

    def listing(self) -> dict[str, Any]:
        x_vector_dim = len(self.voice.x_vector) // 4
        entry: dict[str, Any] = {
            "name": self.name,
            "consent": self.consent,
            "created_at": self.created_at,
            "file_size": self.file_size,
            "mime_type": self.mime_type,
            "embedding_source": "audio",
            "embedding_dim": x_vector_dim,
        }
        if self.voice.ref_text:
            entry["ref_text"] = self.voice.ref_text
        if self.speaker_description:
            entry["speaker_description"] = self.speaker_description
        return entry


class VoiceExists(Exception):
    """A voice of that name (case aside) is kept already."""


class VoicesFull(Exception):
    """The store holds its limit of voices."""


class VoiceStore(Protocol):
    async def add(self, voice: UploadedVoice, max_voices: int) -> None:
        """Keep a new voice; VoiceExists for a name taken, VoicesFull at `max_voices`."""

    async def get(self, name: str) -> UploadedVoice | None:
        """The voice of that name, case aside."""

    async def all(self) -> list[UploadedVoice]:
        """Every voice, oldest first."""

    async def delete(self, name: str) -> bool:
        """Forget the voice of that name, case aside; False if there was none."""

    async def close(self) -> None: ...


def encode(voice: UploadedVoice) -> bytes:
    return msgspec.msgpack.encode(voice)


def decode(data: bytes) -> UploadedVoice:
    return msgspec.msgpack.decode(data, type=UploadedVoice)
