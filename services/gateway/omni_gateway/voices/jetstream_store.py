"""The voice store of Distributed mode and Kubernetes: a NATS JetStream key-value bucket
(`omni-voices-<pipeline>`), one key per voice (its name in lower case), so every gateway replica
sees the same voices. An upload is a create, which fails where the key exists: of two uploads of
one name one wins. The limit on voices is counted before the create: two gateways uploading at
the same moment may each let one voice past it."""

from __future__ import annotations

from typing import Any

import nats.js.errors
from nats.aio.client import Client as NatsClient

from omni_gateway.jetstream import key_value
from omni_gateway.voices.store import UploadedVoice, VoiceExists, VoicesFull, decode, encode


class JetStreamVoiceStore:
    def __init__(self, kv: Any) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, nc: NatsClient, pipeline: str) -> JetStreamVoiceStore:
        return cls(await key_value(nc.jetstream(), f"omni-voices-{pipeline}"))

    async def _keys(self) -> list[str]:
        try:
            return list(await self._kv.keys())
        except nats.js.errors.NoKeysError:
            return []

    async def add(self, voice: UploadedVoice, max_voices: int) -> None:
        if len(await self._keys()) >= max_voices:
            raise VoicesFull(max_voices)
        try:
            await self._kv.create(voice.key, encode(voice))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise VoiceExists(voice.name) from None

    async def get(self, name: str) -> UploadedVoice | None:
        try:
            entry = await self._kv.get(name.lower())
        except nats.js.errors.KeyNotFoundError:
            return None
        return None if entry.value is None else decode(entry.value)

    async def all(self) -> list[UploadedVoice]:
        voices = [v for key in await self._keys() if (v := await self.get(key)) is not None]
        return sorted(voices, key=lambda v: (v.created_at, v.key))

    async def delete(self, name: str) -> bool:
        if await self.get(name) is None:
            return False
        await self._kv.purge(name.lower())
        return True

    async def close(self) -> None:
        pass
