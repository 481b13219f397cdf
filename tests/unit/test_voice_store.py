"""Both voice stores, held to one contract: SQLite on a real file (omni serve's) and a NATS
JetStream key-value bucket on a real nats-server with JetStream on (Distributed mode's,
Kubernetes'). Names unique case aside (between gateways each with its own connection too), the
limit, a voice as it went in, deleting, and voices that outlive the store that kept them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest
import torch

from omni_cli.natsd import EmbeddedNats
from omni_gateway.voices.jetstream_store import JetStreamVoiceStore
from omni_gateway.voices.sqlite_store import SqliteVoiceStore
from omni_gateway.voices.store import UploadedVoice, VoiceExists, VoicesFull, VoiceStore
from omni_pipeline.voices import VoicePrint

Opener = Callable[[], Awaitable[VoiceStore]]
"""Opens another gateway's store on the same voices."""


def voice(name: str, created_at: int = 1000, in_context: bool = True) -> UploadedVoice:
    codes = torch.arange(48).reshape(3, 16) if in_context else None
    kept = VoicePrint.of(torch.linspace(-1, 1, 8), codes, "Its words." if in_context else None)
    return UploadedVoice(
        name=name, consent="c-1", created_at=created_at, mime_type="audio/wav", file_size=10, seconds=1.5,
        voice=kept,
    )  # fmt: skip


@pytest.fixture(params=["sqlite", "jetstream"])
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened: list[VoiceStore] = []
    connections: list[nats.NATS] = []
    server = None
    if request.param == "jetstream":
        server = EmbeddedNats(args=("-js", "-sd", str(tmp_path / "jetstream")))

    async def open_one() -> VoiceStore:
        store: VoiceStore
        if server is None:
            store = await SqliteVoiceStore.open(tmp_path / "state")
        else:
            nc = await nats.connect(server.url)
            connections.append(nc)
            store = await JetStreamVoiceStore.open(nc, "test")
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await store.close()
    for nc in connections:
        await nc.close()
    if server is not None:
        server.stop()


async def test_a_voice_comes_back_as_it_went_in_and_outlives_its_store(opener: Opener) -> None:
    store = await opener()
    await store.add(voice("Narrator"), 4)
    await store.add(voice("plain", 1001, in_context=False), 4)
    other = await opener()  # another gateway, or the same one started again
    got = await other.get("NARRATOR")
    assert got == voice("Narrator")
    assert got is not None
    x_vector, codes = got.voice.tensors()
    assert torch.equal(x_vector, torch.linspace(-1, 1, 8))
    assert codes is not None and torch.equal(codes, torch.arange(48).reshape(3, 16))
    plain = await other.get("plain")
    assert plain is not None and plain.voice.tensors()[1] is None and plain.voice.ref_text is None
    assert [v.name for v in await other.all()] == ["Narrator", "plain"]
    assert await other.get("nobody") is None


async def test_a_name_is_taken_once_case_aside_and_the_limit_holds(opener: Opener) -> None:
    one, two = await opener(), await opener()
    await one.add(voice("Echo"), 2)
    with pytest.raises(VoiceExists):
        await two.add(voice("echo"), 2)
    both = one.add(voice("race"), 5), two.add(voice("RACE"), 5)
    results = await asyncio.gather(*both, return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "VoiceExists"]
    with pytest.raises(VoicesFull):
        await one.add(voice("third"), 2)


async def test_a_voice_deleted_is_gone_everywhere_and_its_name_free(opener: Opener) -> None:
    one, two = await opener(), await opener()
    await one.add(voice("Gone"), 4)
    assert await two.delete("gone")
    assert not await two.delete("gone")
    assert await one.get("Gone") is None and await one.all() == []
    await one.add(voice("GONE"), 4)
    assert [v.name for v in await two.all()] == ["GONE"]
