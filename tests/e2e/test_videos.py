"""Video jobs end to end: `omni serve examples/tiny-video.yaml` (Wan 2.1's text encoder,
transformer and VAE as three stages: random weights, real diffusers loading and sampling) and
the official openai client's Videos API; vLLM-Omni's /v1/videos/sync; jobs that outlive the
gateway (killed, and stopped and started again) in the SQLite job store."""

from __future__ import annotations

import io
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import av
import httpx
import numpy as np
import openai
import pytest
import yaml
from PIL import Image

from omni_cli.natsd import EmbeddedNats
from omni_cli.ports import free_port
from tests.deployment import deployed, metric_values
from tests.e2e.test_batches import batch_of, ended, lines_of
from tests.helpers import (
    PIPELINE_RESTARTS_TIMEOUT_S,
    ROOT,
    assert_all_gone,
    gateway_of,
    openai_client,
    serve_on_port,
    served_example,
    wait_for,
)
from tests.openai_schema import violations

# The SDK warns of OpenAI's own service's end at every videos call: not ours to heed.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


KEYS = ("unused", "someone-else")
"""The served demo's API keys: the openai client's (tests.helpers.openai_client) and another's."""
OWNER: Final = httpx.Client(timeout=5, headers={"Authorization": f"Bearer {KEYS[0]}"})
"""Plain HTTP calls, with the openai client's key: the jobs they see are the same."""


@pytest.fixture(scope="module")
def video_demo(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """tiny-video served with API keys: each key sees its own jobs."""
    env = {"OMNI_API_KEYS": ",".join(KEYS)}
    with served_example("tiny-video.yaml", demo_dir, tmp_path_factory.mktemp("logs"), env) as base:
        yield base


def frames_of(mp4: bytes) -> tuple[list[np.ndarray], float]:
    """An MP4's decoded frames (RGB) and its frame rate."""
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        return frames, float(stream.average_rate or 0)


def finished(client: openai.OpenAI, video_id: str, timeout: float = 120) -> tuple[Any, list[tuple[str, int]]]:
    """The job once it has ended, and every (status, progress) seen on the way."""
    seen: list[tuple[str, int]] = []

    def done() -> Any:
        v = client.videos.retrieve(video_id)
        seen.append((v.status, v.progress))
        return v if v.status in ("completed", "failed") else None

    return wait_for(done, timeout, f"video job {video_id} to end", interval=0.005), seen


def test_a_job_runs_shows_its_progress_and_serves_its_video(video_demo: str) -> None:
    client = openai_client(video_demo)
    job = client.videos.create(
        prompt="a red fox in the snow", seconds="2", size="64x48", extra_body={"num_inference_steps": 400}
    )
    assert (job.object, job.status, job.progress, job.prompt) == (
        "video",
        "queued",
        0,
        "a red fox in the snow",
    )
    assert (job.size, job.seconds, job.model, job.completed_at) == ("64x48", "2", "tiny-video", None)

    done, seen = finished(client, job.id)
    assert done.status == "completed" and done.progress == 100 and done.error is None, done
    progress = [p for s, p in seen if s == "in_progress"]
    # It moves with the steps: 400 steps of about 10 ms, reported at most every 0.2 s.
    assert progress == sorted(progress) and len(set(progress) - {0}) >= 2, seen
    assert done.completed_at is not None and done.expires_at == done.completed_at + 86400
    counted = metric_values(f"{video_demo}/metrics", ("omni_gateway_video_jobs_total",))
    assert counted["omni_gateway_video_jobs_total"] >= 1

    mp4 = client.videos.download_content(job.id).read()
    frames, fps = frames_of(mp4)
    assert len(frames) == 17 and fps == 8 and frames[0].shape == (48, 64, 3)  # 2 s at 8 fps, 4k + 1
    for variant in ("thumbnail", "spritesheet"):
        img = Image.open(io.BytesIO(client.videos.download_content(job.id, variant=variant).read()))
        assert img.format == "WEBP" and img.height == 48
    assert img.width == 8 * 64  # eight frames side by side

    # Range requests, as a player seeks.
    r = OWNER.get(f"{video_demo}/v1/videos/{job.id}/content", headers={"Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == mp4[100:200]
    assert r.headers["content-range"] == f"bytes 100-199/{len(mp4)}"

    assert job.id in [v.id for v in client.videos.list(order="desc", limit=100).data]

    remix = client.videos.remix(job.id, prompt="a blue fox in the snow")
    assert remix.remixed_from_video_id == job.id and remix.prompt == "a blue fox in the snow"
    remixed, _ = finished(client, remix.id)
    assert (remixed.status, remixed.size, remixed.seconds) == ("completed", "64x48", "2")

    deleted = client.videos.delete(job.id)
    assert deleted.deleted and deleted.id == job.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(job.id)


def test_list_pages_in_both_orders(video_demo: str) -> None:
    client = openai_client(video_demo)
    ids = [
        client.videos.create(prompt=f"clip {i}", size="32x32", extra_body={"num_inference_steps": 1}).id
        for i in range(3)
    ]
    for i in ids:
        finished(client, i)
    newest = client.videos.list(limit=2, order="desc")
    assert [v.id for v in newest.data] == ids[:0:-1] and newest.has_more
    after = client.videos.list(limit=2, order="asc", after=ids[0])
    assert [v.id for v in after.data] == ids[1:]
    assert [v.id for v in client.videos.list(order="desc", limit=100)][:3] == ids[::-1]  # the SDK pages on


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "63x48"}, "size"),
        ({"size": "512x512"}, "size"),
        ({"seconds": "30"}, "seconds"),
        ({"seconds": "four"}, "seconds"),
        ({"extra_body": {"num_frames": 10}}, "num_frames"),
        ({"extra_body": {"fps": 99}}, "fps"),
        ({"extra_body": {"frames_per_second": 8}}, "frames_per_second"),
        ({"input_reference": ("cat.png", b"\x89PNG...", "image/png")}, "input_reference"),
        ({"model": "sora-2"}, "model"),
    ],
)
def test_what_the_model_cannot_make_is_a_400_before_a_job_exists(
    video_demo: str, fields: dict[str, Any], param: str
) -> None:
    client = openai_client(video_demo)
    before = [v.id for v in client.videos.list(limit=100)]
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as refused:
        client.videos.create(prompt="x", **fields)
    assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
    assert [v.id for v in client.videos.list(limit=100)] == before


def test_json_bodies_and_refusals_of_the_other_calls(video_demo: str) -> None:
    client = openai_client(video_demo)
    # A job of the most steps a request may ask (seconds of work), so that it is still running
    # when asked for its content or a remix (a job of the default steps could end first: it
    # once did, under a full suite's load); then deleted, which ends its run.
    long = {"prompt": "rain", "size": "32x32", "seconds": 1, "num_inference_steps": 1000}
    r = OWNER.post(f"{video_demo}/v1/videos", json=long)
    assert r.status_code == 200 and (r.json()["status"], r.json()["seconds"]) == ("queued", "1"), r.text
    running = r.json()["id"]
    with pytest.raises(openai.ConflictError):  # no remix of a video not made yet
        client.videos.remix(running, prompt="snow")
    assert OWNER.get(f"{video_demo}/v1/videos/{running}/content").status_code == 409  # nor its content
    client.videos.delete(running)
    queued = client.videos.create(prompt="rain", size="32x32", seconds="1").id  # type: ignore[arg-type]
    finished(client, queued)
    bad = OWNER.get(f"{video_demo}/v1/videos/{queued}/content", params={"variant": "gif"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "variant"
    assert OWNER.get(f"{video_demo}/v1/videos", params={"after": "video_nope"}).status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_nope")
    # A video pipeline makes no images.
    with pytest.raises(openai.BadRequestError):
        client.images.generate(model="tiny-video", prompt="x")


def test_sync_answers_with_the_mp4(video_demo: str) -> None:
    """vLLM-Omni's /v1/videos/sync: the same form, the MP4 itself in the answer, no job."""
    before = [v.id for v in openai_client(video_demo).videos.list(limit=100)]
    form = {"prompt": "a lighthouse", "size": "48x32", "num_frames": "5", "num_inference_steps": "3"}
    r = OWNER.post(f"{video_demo}/v1/videos/sync", data=form, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert r.headers["x-model"] == "tiny-video" and float(r.headers["x-inference-time-s"]) > 0
    frames, _ = frames_of(r.content)
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    refused = OWNER.post(f"{video_demo}/v1/videos/sync", data={**form, "num_frames": "6"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_frames"
    assert [v.id for v in openai_client(video_demo).videos.list(limit=100)] == before


def video_line(custom_id: str, **body: Any) -> dict[str, Any]:
    """A batch's line asking /v1/videos for a clip of five frames."""
    clip = {"model": "tiny-video", "prompt": f"a clip for {custom_id}", "size": "32x32", "num_frames": 5}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/videos",
        "body": {**clip, "num_inference_steps": 2, **body},
    }


def test_a_batch_of_videos_makes_jobs_of_its_owner(video_demo: str) -> None:
    """Each line of a /v1/videos batch is a job of the batch's owner; its output line the
    finished job (OpenAI's VideoResource but for its size), whose video downloads as any job's; a
    line the endpoint refuses is in the error file with its 400; another key sees neither."""
    client = openai_client(video_demo)
    lines = [video_line("fox"), video_line("owl", seed=7), video_line("bad", num_frames=6)]
    batch = batch_of(client, lines, endpoint="/v1/videos")
    done = ended(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    out = {x["custom_id"]: x["response"] for x in lines_of(client, done.output_file_id)}
    assert set(out) == {"fox", "owl"}
    for response in out.values():
        job = response["body"]
        assert response["status_code"] == 200 and job["status"] == "completed", response
        ours = {"size": "720x1280", "seconds": "4"}  # sizes and lengths past OpenAI's enums are ours
        assert violations({**job, **ours}, "VideoResource") is None
        assert client.videos.retrieve(job["id"]).status == "completed"
        frames, _ = frames_of(client.videos.download_content(job["id"]).read())
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    [error] = lines_of(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "num_frames"

    other = openai.OpenAI(base_url=f"{video_demo}/v1", api_key=KEYS[1], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.videos.retrieve(out["fox"]["body"]["id"])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)


def test_a_cancelled_video_batch_deletes_its_unfinished_jobs(video_demo: str) -> None:
    """Cancel while a line's job runs: the batch ends `cancelled`, its lines in the error file,
    and the jobs its lines made and never finished are gone (their runs ended)."""
    client = openai_client(video_demo)
    before = {v.id for v in client.videos.list(limit=100)}
    lines = [video_line(f"long-{i}", num_inference_steps=1000) for i in range(2)]
    batch = batch_of(client, lines, endpoint="/v1/videos")
    wait_for(
        lambda: any(v.id not in before and v.progress > 0 for v in client.videos.list(limit=100)),
        60,
        "a line's job to run",
    )
    client.batches.cancel(batch.id)
    done = ended(client, batch.id)
    assert done.status == "cancelled" and done.output_file_id is None, done
    errors = {x["custom_id"]: x["error"]["code"] for x in lines_of(client, done.error_file_id)}
    assert errors == {"long-0": "batch_cancelled", "long-1": "batch_cancelled"}
    assert {v.id for v in client.videos.list(limit=100)} == before


@pytest.mark.timeout(PIPELINE_RESTARTS_TIMEOUT_S)
def test_jobs_outlive_the_gateway(demo_dir: Path, tmp_path: Path) -> None:
    """A job running when the gateway is killed completes once the supervisor has started it
    again (the new gateway takes it up when the dead one's lease lapses); one running when
    omni serve is stopped is given back and completes after it starts again; finished jobs
    are listed and served across restarts. A batch's video line whose job runs through the
    kill: the next gateway finds that job (by the id the line gives it) instead of making
    another, and the batch completes with it."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-video.yaml").read_text())
    spec["spec"]["gateway"]["videos"] = {"stateDir": str(tmp_path / "state"), "leaseS": 2, "concurrency": 2}
    spec["spec"]["gateway"]["batches"] = {"stateDir": str(tmp_path / "state"), "leaseS": 2}
    pipeline = tmp_path / "tiny-video.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    port = free_port()
    long = {"size": "64x64", "extra_body": {"num_inference_steps": 150, "num_frames": 17}}

    serve, client = serve_on_port(pipeline, demo_dir, tmp_path / "serve-1.log", port)
    try:
        quick = client.videos.create(prompt="first", size="32x32", extra_body={"num_inference_steps": 2})
        assert finished(client, quick.id)[0].status == "completed"
        killed = client.videos.create(prompt="through a kill", **long)
        batch = batch_of(
            client, [video_line("line", size="64x64", num_frames=17, num_inference_steps=150)], "/v1/videos"
        )
        wait_for(
            lambda: len([v for v in client.videos.list() if v.progress > 0]) == 3, 60, "both jobs to run"
        )
        [line_job] = [v.id for v in client.videos.list() if v.id not in (quick.id, killed.id)]
        old = gateway_of(serve)
        os.kill(old.pid, signal.SIGKILL)
        done, _ = finished(client, killed.id, timeout=180)  # asked of the new gateway, same port
        assert done.status == "completed", done
        assert gateway_of(serve).pid != old.pid
        assert "gateway died" in serve.output()
        lined = ended(client, batch.id, timeout=180)
        assert lined.status == "completed", lined
        [out] = lines_of(client, lined.output_file_id)
        assert out["response"]["body"]["id"] == line_job
        assert {v.id for v in client.videos.list(limit=100)} == {quick.id, killed.id, line_job}

        stopped = client.videos.create(prompt="through a stop", **long)
        wait_for(lambda: client.videos.retrieve(stopped.id).progress > 0, 60, "the job to be running")
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)

    serve, client = serve_on_port(pipeline, demo_dir, tmp_path / "serve-2.log", port)
    try:
        listed = {v.id: v for v in client.videos.list(limit=100)}
        assert set(listed) == {quick.id, killed.id, line_job, stopped.id}
        assert listed[quick.id].status == "completed" and listed[killed.id].status == "completed"
        frames, _ = frames_of(client.videos.download_content(quick.id).read())
        assert len(frames) >= 2
        done, _ = finished(client, stopped.id, timeout=180)
        assert done.status == "completed", done
        assert len(frames_of(client.videos.download_content(stopped.id).read())[0]) == 17
        assert re.search(r"video job \S+ completed", serve.output())
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)


def test_distributed_jobs_live_in_jetstream(demo_dir: Path, tmp_path: Path) -> None:
    """Distributed mode: the stages and gateways as processes of their own on a nats-server with
    JetStream on, and the jobs in its key-value and object stores. A job running when its
    gateway is killed completes on a gateway started afterwards, which also lists the finished
    job and serves its video (from the object store: it never had the file)."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-video.yaml").read_text())
    spec["spec"].update(mode="Distributed", nats={"url": ""}, connectors={"default": {"kind": "inline"}})
    spec["spec"]["gateway"]["videos"] = {"stateDir": str(tmp_path / "state"), "leaseS": 2, "concurrency": 2}
    spec["spec"]["gateway"]["batches"] = {"stateDir": str(tmp_path / "state"), "leaseS": 2}
    pipeline = tmp_path / "tiny-video.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    server = EmbeddedNats(args=("-js", "-sd", str(tmp_path / "jetstream")))
    try:
        layout = {"encoder": 1, "dit": 1, "vae": 1}
        with deployed(pipeline, layout, 1, server.url, demo_dir, tmp_path) as d:
            client = openai_client(d.base)
            quick = client.videos.create(prompt="first", size="32x32", extra_body={"num_inference_steps": 2})
            assert finished(client, quick.id)[0].status == "completed"
            mp4 = client.videos.download_content(quick.id).read()
            running = client.videos.create(
                prompt="through a kill",
                size="64x64",
                extra_body={"num_inference_steps": 150, "num_frames": 17},
            )
            wait_for(lambda: client.videos.retrieve(running.id).progress > 0, 60, "the job to be running")
            d.gateways[0][0].proc.kill()

            other = openai_client(d.add_gateway())
            assert {v.id for v in other.videos.list(limit=100)} == {quick.id, running.id}
            assert other.videos.download_content(quick.id).read() == mp4
            done, _ = finished(other, running.id, timeout=180)
            assert done.status == "completed", done
            assert len(frames_of(other.videos.download_content(running.id).read())[0]) == 17
        assert not (tmp_path / "state" / "tiny-video" / "jobs.sqlite3").exists()  # nothing in SQLite
    finally:
        server.stop()
