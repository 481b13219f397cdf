"""Both video job stores, held to one contract: SQLite on a real file (omni serve's) and NATS
JetStream's key-value and object stores on a real nats-server with JetStream on (Distributed
mode's, Kubernetes'). Limits, ownership, paging, leases (one claim wins, between gateways each
with its own connection), giving jobs back, expiry, files."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest

from omni_cli.natsd import EmbeddedNats
from omni_gateway.videos.jetstream_store import JetStreamJobStore
from omni_gateway.videos.sqlite_store import SqliteJobStore
from omni_gateway.videos.store import JobStore, StoreFull, VideoJob

Opener = Callable[[], Awaitable[JobStore]]
"""Opens another gateway's store on the same jobs."""


def job(n: int, owner: str = "", created_at: int = 1000) -> VideoJob:
    return VideoJob(
        id=f"video_{n}",
        owner=owner,
        status="queued",
        created_at=created_at + n,
        model="m",
        prompt=f"p{n}",
        size="64x64",
        seconds="2",
        request={"prompt": f"p{n}", "seed": n},
    )


@pytest.fixture(params=["sqlite", "jetstream"])
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened: list[JobStore] = []
    connections: list[nats.NATS] = []
    server = None
    if request.param == "jetstream":
        server = EmbeddedNats(args=("-js", "-sd", str(tmp_path / "jetstream")))

    async def open_one() -> JobStore:
        n = len(opened)
        store: JobStore
        if server is None:
            store = await asyncio.to_thread(SqliteJobStore, tmp_path / "state")
        else:
            nc = await nats.connect(server.url)
            connections.append(nc)
            store = await JetStreamJobStore.open(nc, "test", tmp_path / f"cache-{n}")
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await store.close()
    for nc in connections:
        await nc.close()
    if server is not None:
        server.stop()


@pytest.fixture
async def store(opener: Opener) -> JobStore:
    return await opener()


async def test_limits_count_unfinished_jobs_per_key_and_in_all(store: JobStore) -> None:
    await store.add(job(1, "a"), max_queued=3, max_per_owner=2)
    await store.add(job(2, "a"), max_queued=3, max_per_owner=2)
    with pytest.raises(StoreFull) as full:
        await store.add(job(3, "a"), max_queued=3, max_per_owner=2)
    assert full.value.scope == "key"
    await store.add(job(4, "b"), max_queued=3, max_per_owner=2)
    with pytest.raises(StoreFull) as full:
        await store.add(job(5, "c"), max_queued=3, max_per_owner=2)
    assert full.value.scope == "all"
    [claimed] = await store.claim("g", now=0, lease_s=10, limit=1)
    assert await store.update(claimed.id, "g", status="completed", progress=100)  # no longer counted
    await store.add(job(6, "a"), max_queued=3, max_per_owner=2)


async def test_a_key_sees_only_its_own_jobs_paged_in_order(store: JobStore) -> None:
    for n in range(5):
        await store.add(job(n, "a"), 100, 100)
    await store.add(job(9, "b"), 100, 100)
    assert await store.get("video_9", "a") is None and await store.get("video_9", "b") is not None
    page, more = await store.page("a", None, 2, ascending=False)
    assert [j.id for j in page] == ["video_4", "video_3"] and more
    page, more = await store.page("a", "video_3", 2, ascending=False)
    assert [j.id for j in page] == ["video_2", "video_1"] and more
    page, more = await store.page("a", "video_1", 2, ascending=False)
    assert [j.id for j in page] == ["video_0"] and not more
    page, _ = await store.page("a", "video_1", 10, ascending=True)
    assert [j.id for j in page] == ["video_2", "video_3", "video_4"]
    with pytest.raises(KeyError):
        await store.page("a", "video_9", 2, ascending=True)  # another key's job is no cursor
    assert not await store.delete("video_9", "a")
    assert await store.delete("video_9", "b") and await store.get("video_9", None) is None


async def test_one_claim_wins_and_a_lapsed_lease_is_taken_over(opener: Opener) -> None:
    """Four gateways, each with its own connection to the store, claim at once: each job goes
    to one of them."""
    gateways = [await opener() for _ in range(4)]
    for n in range(6):
        await gateways[0].add(job(n), 100, 100)
    await seen_by_all(gateways, {f"video_{n}" for n in range(6)})
    claims = await asyncio.gather(*(g.claim(f"g{i}", 100.0, 10, 6) for i, g in enumerate(gateways)))
    ids = [j.id for c in claims for j in c]
    assert sorted(ids) == [f"video_{n}" for n in range(6)]  # each once

    holder = next(i for i, c in enumerate(claims) if c)
    mine = [j.id for j in claims[holder]]
    assert await gateways[holder].renew(f"g{holder}", mine, 130.0) == set(mine)
    others = {j.id for i, c in enumerate(claims) if i != holder for j in c}
    taken: set[str] = set()
    async with asyncio.timeout(10):  # the others' leases lapsed at 110 (once its view has them)
        while taken != others:
            taken |= {j.id for j in await gateways[holder].claim(f"g{holder}", 120.0, 10, 6)}
            await asyncio.sleep(0.01)
    other = (holder + 1) % 4
    assert not await gateways[other].update(mine[0], f"g{other}", progress=5)  # not its job


async def seen_by_all(gateways: list[JobStore], ids: set[str]) -> None:
    """Each gateway's view has every job (JetStream's mirrors follow the bucket's watch)."""
    async with asyncio.timeout(10):
        for g in gateways:
            while not ids <= await g.ids():
                await asyncio.sleep(0.01)


async def test_a_stopping_gateway_gives_its_jobs_back_for_the_next_at_once(opener: Opener) -> None:
    first, second = await opener(), await opener()
    await first.add(job(1), 10, 10)
    await seen_by_all([first], {"video_1"})
    [j] = await first.claim("g", now=0, lease_s=60, limit=5)
    await first.update(j.id, "g", status="in_progress", progress=40)
    await first.release("g", [j.id])
    again = await first.get(j.id, None)
    assert again is not None and (again.status, again.progress) == ("queued", 0)
    async with asyncio.timeout(10):  # the next gateway takes it at once, not after 60 s
        while not (taken := await second.claim("h", now=1, lease_s=60, limit=5)):
            await asyncio.sleep(0.01)
    assert [x.id for x in taken] == [j.id]


async def test_expired_jobs_are_deleted(store: JobStore) -> None:
    for n in range(3):
        await store.add(job(n), 10, 10)
    for j in await store.claim("g", 0, 60, 3):
        await store.update(j.id, "g", status="completed", expires_at=100 + int(j.id[-1]))
    assert await store.expired(100.5) == ["video_0"]
    assert await store.ids() == {"video_1", "video_2"}


async def test_a_job_reads_back_as_it_was_stored_and_its_files_as_written(store: JobStore) -> None:
    await store.add(job(1, "a"), 10, 10)
    [j] = await store.claim("g", 0, 60, 1)
    await store.update(j.id, "g", status="failed", error={"code": "invalid_request", "message": "no"})
    got = await store.get("video_1", "a")
    assert got is not None and got.request == {"prompt": "p1", "seed": 1}
    assert got.resource()["error"] == {"code": "invalid_request", "message": "no"}
    assert got.resource()["object"] == "video" and got.resource()["remixed_from_video_id"] is None

    video = bytes(range(256)) * 1000
    await store.put_files("video_1", {"video.mp4": video, "thumbnail.webp": b"RIFF"})
    path = await store.file("video_1", "video.mp4")
    assert path is not None and path.read_bytes() == video
    assert await store.file("video_1", "spritesheet.webp") is None
    assert await store.file_ids() == {"video_1"}
    await store.remove_files(["video_1"])
    assert await store.file("video_1", "video.mp4") is None and await store.file_ids() == set()


async def test_a_job_deleted_elsewhere_is_lost_to_its_holder(opener: Opener) -> None:
    """Deleted through another gateway while it runs: its holder's next write says it has lost
    it (so the runner ends the run), and its files can go."""
    holder, other = await opener(), await opener()
    await holder.add(job(1), 10, 10)
    await seen_by_all([holder, other], {"video_1"})
    [j] = await holder.claim("g", 0, 60, 1)
    assert await other.delete(j.id, "")
    assert not await holder.update(j.id, "g", progress=50)
    assert await holder.renew("g", [j.id], 100.0) == set()
    assert await holder.get(j.id, None) is None


async def test_every_gateway_drops_its_copies_of_a_deleted_jobs_files(opener: Opener) -> None:
    """A file served by two gateways (JetStream: each keeps a local copy) and then deleted
    through one: neither keeps it."""
    first, second = await opener(), await opener()
    await first.add(job(1), 10, 10)
    await first.put_files("video_1", {"video.mp4": b"mp4"})
    await seen_by_all([second], {"video_1"})
    copies = [await g.file("video_1", "video.mp4") for g in (first, second)]
    assert all(c is not None and c.read_bytes() == b"mp4" for c in copies)
    assert await second.delete("video_1", "")
    await first.remove_files(["video_1"])  # what the route does after a delete
    async with asyncio.timeout(10):
        while any(c is not None and c.exists() for c in copies):
            await asyncio.sleep(0.01)
    assert await first.file("video_1", "video.mp4") is None
