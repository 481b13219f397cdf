"""The voice store of Distributed mode and Kubernetes: a NATS JetStream key-value bucket
(`omni-voices-<pipeline>`), one key per voice (its name in lower case), so every gateway replica
sees the same voices. An upload is a create, which fails where the key exists: of two uploads of
one name one wins. The limit on voices is counted before the create: two gateways uploading at
the same moment may each let one voice past it.

The voices are listed from the bucket's stream (the subjects it holds, each read with `get`,
which skips deleted ones), not with `KeyValue.keys()`: its watcher can end its listing before
the last key while writes land (nats-io/nats.py#842), and a listing short of a voice lets an
upload past the limit."""

from __future__ import annotations

from typing import Any

import nats.js.errors
from nats.aio.client import Client as NatsClient

from omni_gateway.jetstream import key_value
from omni_gateway.voices.store import UploadedVoice, VoiceExists, VoicesFull, decode, encode


class JetStreamVoiceStore:
    def __init__(self, js: Any, bucket: str, kv: Any) -> None:
        self._js = js
        self._kv = kv
        self._stream = f"KV_{bucket}"  # a bucket's stream and subjects, as ADR-8 names them
        self._subjects = f"$KV.{bucket}."

    @classmethod
    async def open(cls, nc: NatsClient, pipeline: str) -> JetStreamVoiceStore:
        js, bucket = nc.jetstream(), f"omni-voices-{pipeline}"
        return cls(js, bucket, await key_value(js, bucket))

    async def _held(self) -> list[UploadedVoice]:
        """The voices the bucket holds now, each read once."""
        info = await self._js.stream_info(self._stream, subjects_filter=f"{self._subjects}>")
        keys = [s.removeprefix(self._subjects) for s in info.state.subjects or {}]
        return [v for key in keys if (v := await self.get(key)) is not None]

    async def add(self, voice: UploadedVoice, max_voices: int) -> None:
        if len(await self._held()) >= max_voices:
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
        return sorted(await self._held(), key=lambda v: (v.created_at, v.key))

    async def delete(self, name: str) -> bool:
        if await self.get(name) is None:
            return False
        await self._kv.purge(name.lower())
        return True

    async def close(self) -> None:
        pass
