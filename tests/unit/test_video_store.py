"""The video job store on a real SQLite file: limits, ownership, paging, leases (one claim wins,
across connections as across gateway processes), giving jobs back, expiry."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omni_gateway.videos.store import SqliteJobStore, StoreFull, VideoJob


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


@pytest.fixture
def store(tmp_path: Path) -> SqliteJobStore:
    return SqliteJobStore(tmp_path / "jobs.sqlite3")


def test_limits_count_unfinished_jobs_per_key_and_in_all(store: SqliteJobStore) -> None:
    store.add(job(1, "a"), max_queued=3, max_per_owner=2)
    store.add(job(2, "a"), max_queued=3, max_per_owner=2)
    with pytest.raises(StoreFull) as full:
        store.add(job(3, "a"), max_queued=3, max_per_owner=2)
    assert full.value.scope == "key"
    store.add(job(4, "b"), max_queued=3, max_per_owner=2)
    with pytest.raises(StoreFull) as full:
        store.add(job(5, "c"), max_queued=3, max_per_owner=2)
    assert full.value.scope == "all"
    [claimed] = store.claim("g", now=0, lease_s=10, limit=1)
    assert store.update(claimed.id, "g", status="completed", progress=100)  # finished: no longer counted
    store.add(job(6, "a"), max_queued=3, max_per_owner=2)


def test_a_key_sees_only_its_own_jobs_paged_in_order(store: SqliteJobStore) -> None:
    for n in range(5):
        store.add(job(n, "a"), 100, 100)
    store.add(job(9, "b"), 100, 100)
    assert store.get("video_9", "a") is None and store.get("video_9", "b") is not None
    page, more = store.page("a", None, 2, ascending=False)
    assert [j.id for j in page] == ["video_4", "video_3"] and more
    page, more = store.page("a", "video_3", 2, ascending=False)
    assert [j.id for j in page] == ["video_2", "video_1"] and more
    page, more = store.page("a", "video_1", 2, ascending=False)
    assert [j.id for j in page] == ["video_0"] and not more
    page, _ = store.page("a", "video_1", 10, ascending=True)
    assert [j.id for j in page] == ["video_2", "video_3", "video_4"]
    with pytest.raises(KeyError):
        store.page("a", "video_9", 2, ascending=True)  # another key's job is no cursor
    assert not store.delete("video_9", "a") and store.delete("video_9", "b")


def test_one_claim_wins_and_a_lapsed_lease_is_taken_over(tmp_path: Path) -> None:
    """Four gateways (each its own connection to the file) claim at once: each job goes to one."""
    path = tmp_path / "jobs.sqlite3"
    stores = [SqliteJobStore(path) for _ in range(4)]
    for n in range(6):
        stores[0].add(job(n), 100, 100)
    with ThreadPoolExecutor(4) as pool:
        claims = list(pool.map(lambda i: stores[i].claim(f"g{i}", 100.0, 10, 6), range(4)))
    ids = [j.id for c in claims for j in c]
    assert sorted(ids) == [f"video_{n}" for n in range(6)]  # each once
    assert stores[1].claim("g1", 105.0, 10, 6) == []  # all leased until 110

    holder = next(i for i, c in enumerate(claims) if c)
    mine = [j.id for j in claims[holder]]
    assert stores[holder].renew(f"g{holder}", mine, 130.0) == set(mine)
    others = [j.id for i, c in enumerate(claims) if i != holder for j in c]
    taken = stores[holder].claim(f"g{holder}", 120.0, 10, 6)  # the others' lapsed at 110
    assert sorted(j.id for j in taken) == sorted(others)
    assert not stores[(holder + 1) % 4].update(mine[0], f"g{(holder + 1) % 4}", progress=5)  # not its job


def test_a_stopping_gateway_gives_its_jobs_back_for_the_next_at_once(store: SqliteJobStore) -> None:
    store.add(job(1), 10, 10)
    [j] = store.claim("g", now=0, lease_s=60, limit=5)
    store.update(j.id, "g", status="in_progress", progress=40)
    store.release("g", [j.id])
    again = store.get(j.id, None)
    assert again is not None and (again.status, again.progress) == ("queued", 0)
    assert [x.id for x in store.claim("h", now=1, lease_s=60, limit=5)] == [j.id]  # not after 60 s


def test_expired_jobs_are_deleted(store: SqliteJobStore) -> None:
    for n in range(3):
        store.add(job(n), 10, 10)
    for j in store.claim("g", 0, 60, 3):
        store.update(j.id, "g", status="completed", expires_at=100 + int(j.id[-1]))
    assert store.expired(100.5) == ["video_0"]
    assert store.ids() == {"video_1", "video_2"}


def test_a_job_reads_back_as_it_was_stored(store: SqliteJobStore) -> None:
    store.add(job(1, "a"), 10, 10)
    [j] = store.claim("g", 0, 60, 1)
    store.update(j.id, "g", status="failed", error={"code": "invalid_request", "message": "no"})
    got = store.get("video_1", "a")
    assert got is not None and got.request == {"prompt": "p1", "seed": 1}
    assert got.resource()["error"] == {"code": "invalid_request", "message": "no"}
    assert got.resource()["object"] == "video" and got.resource()["remixed_from_video_id"] is None
