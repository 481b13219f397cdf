"""The Batch API end to end, as its users run it: the official openai client's `files` and
`batches` against `omni serve examples/tiny-omni.yaml` (its store in the test's own directory):
a batch run to its output and error files, a file that fails validation, a cancel, and batches
that outlive the gateway (killed, and omni serve stopped and started again); and in Distributed
mode, two gateways on JetStream, the one running a batch killed."""

from __future__ import annotations

import base64
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from omni_cli.natsd import EmbeddedNats
from omni_cli.ports import free_port
from tests.deployment import deployed, metric_values, metrics_urls
from tests.helpers import (
    HTTP,
    PIPELINE_RESTARTS_TIMEOUT_S,
    ROOT,
    assert_all_gone,
    gateway_of,
    openai_client,
    serve_on_port,
    served,
    wait_for,
)
from tests.openai_schema import violations

pytestmark = pytest.mark.slow

ENDED = ("completed", "failed", "cancelled", "expired")


def pipeline_file(tmp: Path, distributed: bool = False, one_at_a_time: bool = False, **batches: Any) -> Path:
    """examples/tiny-omni.yaml, its batches kept under `tmp` (and `batches` settings besides);
    `one_at_a_time`: its thinker runs one request at a time."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())
    if one_at_a_time:
        spec["spec"]["stages"][0].update(maxInflight=1, maxQueued=32)
    spec["spec"]["gateway"]["batches"] = {"stateDir": str(tmp / "state"), **batches}
    if distributed:
        spec["spec"].update(mode="Distributed", nats={"url": ""}, connectors={"default": {"kind": "inline"}})
    path = tmp / "tiny-omni.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def client(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("batches")
    with served(pipeline_file(tmp, concurrency=1), demo_dir, tmp / "serve.log") as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def chat_line(custom_id: str, tokens: int = 4, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Say something, {custom_id}"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-omni", "messages": messages, "max_tokens": tokens, **body},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def batch_of(
    client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> Any:
    f = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def ended(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    """The batch once it has ended."""

    def done() -> Any:
        b = client.batches.retrieve(batch_id)
        return b if b.status in ENDED else None

    return wait_for(done, timeout, f"batch {batch_id} to end")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_its_output_and_error_files(client: openai.OpenAI) -> None:
    """Every good line answered once in the output file, in OpenAI's output line shape, its body
    what /v1/chat/completions answers (text, and speech where asked); a line the endpoint
    refuses in the error file with the 400 it gives; the batch and file objects valid against
    OpenAI's schema."""
    good = [chat_line(f"req-{i}", tokens=48) for i in range(6)]
    spoken = chat_line("spoken", modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    refused = chat_line("refused", temperature=-1)
    batch = batch_of(client, [*good, refused, spoken])
    assert violations(batch.model_dump(exclude_unset=True), "Batch") is None
    assert (batch.status, batch.endpoint, batch.completion_window) == (
        "validating",
        "/v1/chat/completions",
        "24h",
    )
    done = ended(client, batch.id)
    assert done.status == "completed", done
    assert violations(done.model_dump(exclude_unset=True), "Batch") is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 7, 1)
    assert done.model == "tiny-omni" and done.in_progress_at and done.finalizing_at and done.completed_at

    out = lines_of(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted([*(x["custom_id"] for x in good), "spoken"])
    for line in out:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"], line
        assert violations(response["body"], "CreateChatCompletionResponse") is None
        assert response["body"]["choices"][0]["message"]["content"]
    usages = [x["response"]["body"]["usage"] for x in out]
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (
        sum(u["prompt_tokens"] for u in usages),
        sum(u["completion_tokens"] for u in usages),
    )
    [speech] = [x["response"]["body"]["choices"][0]["message"] for x in out if x["custom_id"] == "spoken"]
    assert base64.b64decode(speech["audio"]["data"])[:4] == b"RIFF"

    [error] = lines_of(client, done.error_file_id)
    assert error["custom_id"] == "refused" and error["error"] is None
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"

    output = client.files.retrieve(done.output_file_id)
    assert (
        output.purpose == "batch_output"
        and output.expires_at
        and violations(output.model_dump(exclude_unset=True), "OpenAIFile") is None
    )
    assert done.id in {b.id for b in client.batches.list()}


def test_a_file_with_bad_lines_fails_the_batch_naming_each(client: openai.OpenAI) -> None:
    """As OpenAI validates: a line that is not JSON, one without custom_id, one for another
    endpoint and a repeated custom_id each named by line; nothing runs."""
    data = b"\n".join(
        [
            json.dumps(chat_line("a")).encode(),
            b"{not json",
            json.dumps({**chat_line("b"), "custom_id": None}).encode(),
            json.dumps({**chat_line("c"), "url": "/v1/embeddings"}).encode(),
            json.dumps(chat_line("a")).encode(),
        ]
    )
    f = client.files.create(file=("bad.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = ended(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    named = [(e.line, e.code, e.param) for e in done.errors.data]
    assert named == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "mismatched_endpoint", "url"),
        (5, "duplicate_custom_id", "custom_id"),
    ]


def test_what_cannot_be_batched_is_refused_at_once(client: openai.OpenAI) -> None:
    """A 400 naming the field: another endpoint, a window other than 24h, a file uploaded for
    something else; a 404 for a file that does not exist; files only for `batch`."""
    f = client.files.create(file=("r.jsonl", jsonl([chat_line("x")])), purpose="batch")
    for kwargs, param in (
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
    ):
        asked = {
            "input_file_id": f.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **kwargs,
        }
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(**asked)  # type: ignore[arg-type]
        assert err.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("r.jsonl", b"{}"), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"  # type: ignore[index]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_a_cancelled_batch_keeps_what_finished(client: openai.OpenAI) -> None:
    """The counts move as lines end; cancelled once some have: it ends `cancelled`, the lines
    that finished in the output file, every other one in the error file as never run; each
    exactly once."""
    lines = [chat_line(f"long-{i}", tokens=48) for i in range(40)]
    batch = batch_of(client, lines)
    running = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 2 and b,
        60,
        "two lines to end",
    )
    assert running.status == "in_progress" and running.request_counts.completed < 40
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = ended(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    out, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert 2 <= len(out) < 40 and len(out) + len(errors) == 40
    assert sorted(x["custom_id"] for x in out + errors) == sorted(x["custom_id"] for x in lines)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_cancelled_while_its_line_waits_for_room_gives_the_room_back(client: openai.OpenAI) -> None:
    """The thinker asleep (level 0: it only stops admitting), a batch's first line waits at the
    gateway for a free slot, holding the one line this gateway may run at once (`concurrency`
    1); cancelled there, the batch gives it back, so once the thinker wakes a later batch runs
    to its end. (A cancel once kept it, and the gateway ran no batch line again.)"""
    base = str(client.base_url).removesuffix("/v1/")
    asleep = {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}]}
    assert HTTP.post(f"{base}/v1/omni/sleep", json={"stage_ids": ["thinker"], "level": 0}).status_code == 200
    try:
        wait_for(
            lambda: HTTP.post(f"{base}/v1/chat/completions", json=asleep).status_code == 503,
            30,
            "the gateway to see the thinker asleep",
        )
        waiting = batch_of(client, [chat_line("waits")])
        wait_for(lambda: client.batches.retrieve(waiting.id).status == "in_progress", 60, "the batch to run")
        client.batches.cancel(waiting.id)
        done = ended(client, waiting.id)
        assert done.status == "cancelled" and done.request_counts.completed == 0, done
    finally:
        assert HTTP.post(f"{base}/v1/omni/wakeup", json={"stage_ids": ["thinker"]}).status_code == 200
    done = ended(client, batch_of(client, [chat_line("after")]).id, timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 1, done


@pytest.mark.timeout(PIPELINE_RESTARTS_TIMEOUT_S)
def test_batches_outlive_the_gateway(demo_dir: Path, tmp_path: Path) -> None:
    """A batch running when the gateway is killed completes once the supervisor has started
    it again (the new gateway takes it up when the dead one's lease lapses); one running when
    omni serve is stopped completes after it starts again. Every custom_id is in the output
    exactly once: lines already done are not run again. One whose window has ended when omni
    serve starts again ends `expired`, its finished lines kept."""
    pipeline = pipeline_file(tmp_path, concurrency=1, leaseS=2)
    port = free_port()
    serve, client = serve_on_port(pipeline, demo_dir, tmp_path / "serve-1.log", port)
    lines = [chat_line(f"r-{i}", tokens=32) for i in range(24)]
    try:
        killed = batch_of(client, lines)
        wait_for(lambda: client.batches.retrieve(killed.id).request_counts.completed >= 3, 60, "lines to end")
        old = gateway_of(serve)
        os.kill(old.pid, signal.SIGKILL)
        done = ended(client, killed.id, timeout=180)  # asked of the new gateway, same port
        assert done.status == "completed" and done.request_counts.completed == 24, done
        assert sorted(x["custom_id"] for x in lines_of(client, done.output_file_id)) == sorted(
            x["custom_id"] for x in lines
        )
        stopped = batch_of(client, lines)
        wait_for(
            lambda: client.batches.retrieve(stopped.id).request_counts.completed >= 3, 60, "lines to end"
        )
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)

    serve, client = serve_on_port(pipeline, demo_dir, tmp_path / "serve-2.log", port)
    try:
        done = ended(client, stopped.id, timeout=180)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        out = [x["custom_id"] for x in lines_of(client, done.output_file_id)]
        assert sorted(out) == sorted(x["custom_id"] for x in lines)
        assert client.batches.retrieve(killed.id).status == "completed"
        late = batch_of(client, lines)
        wait_for(lambda: client.batches.retrieve(late.id).request_counts.completed >= 3, 60, "lines to end")
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)

    # Past its window (24 h cannot pass in a test: its end brought forward in the store while
    # omni serve is down), a batch ends `expired`, what finished kept, the rest never run.
    with sqlite3.connect(tmp_path / "state" / "tiny-omni" / "batches.sqlite3") as db:
        db.execute(
            "UPDATE batches SET record = json_set(record, '$.expires_at', ?) WHERE id = ?",
            (int(time.time()) - 1, late.id),
        )
    serve, client = serve_on_port(pipeline, demo_dir, tmp_path / "serve-3.log", port)
    try:
        done = ended(client, late.id, timeout=180)
        assert done.status == "expired" and done.expired_at, done
        finished = {x["custom_id"] for x in lines_of(client, done.output_file_id)}
        never = {x["custom_id"]: x["error"]["code"] for x in lines_of(client, done.error_file_id)}
        assert len(finished) == done.request_counts.completed >= 3 and len(finished) < 24
        assert set(never.values()) == {"batch_expired"}
        assert finished | set(never) == {x["custom_id"] for x in lines}
    finally:
        serve.interrupt_group()
    assert_all_gone(serve)


def test_speech_batches_with_its_audio_in_the_output_line(client: openai.OpenAI) -> None:
    """/v1/audio/speech, an extension to OpenAI's batchable endpoints: each line's audio, in
    the format it asked for, base64 in its output line's body."""
    lines = [
        {
            "custom_id": f"say-{fmt}",
            "method": "POST",
            "url": "/v1/audio/speech",
            "body": {"model": "tiny-omni", "input": "Hello there", "voice": "alloy", "response_format": fmt},
        }
        for fmt in ("wav", "pcm")
    ]
    done = ended(client, batch_of(client, lines, endpoint="/v1/audio/speech").id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    bodies = {x["custom_id"]: x["response"]["body"] for x in lines_of(client, done.output_file_id)}
    assert base64.b64decode(bodies["say-wav"]["audio"])[:4] == b"RIFF"
    assert (
        bodies["say-wav"]["content_type"] == "audio/wav" and bodies["say-pcm"]["content_type"] == "audio/pcm"
    )
    assert len(base64.b64decode(bodies["say-pcm"]["audio"])) > 0


def test_distributed_batches_live_in_jetstream(demo_dir: Path, tmp_path: Path) -> None:
    """Distributed mode: stages and two gateways as processes of their own on a nats-server with
    JetStream on, files and batches in its key-value and object stores. A batch made on one
    gateway runs on whichever claims it; the gateway running it is killed, the other takes it
    up once the lease lapses and completes it, every custom_id exactly once; both list it and
    serve its output (neither has it on disk first)."""
    pipeline = pipeline_file(tmp_path, distributed=True, concurrency=1, leaseS=2)
    server = EmbeddedNats(args=("-js", "-sd", str(tmp_path / "jetstream")))
    lines = [chat_line(f"r-{i}", tokens=32) for i in range(24)]
    try:
        with deployed(
            pipeline, {"thinker": 1, "talker": 1, "vocoder": 1}, 2, server.url, demo_dir, tmp_path
        ) as d:
            clients = [openai_client(base) for _, base in d.gateways]
            batch = batch_of(clients[0], lines)
            wait_for(
                lambda: clients[1].batches.retrieve(batch.id).request_counts.completed >= 3,
                60,
                "lines to end",
            )
            running = [i for i, (gw, _) in enumerate(d.gateways) if f"batch {batch.id}" in gw.output()]
            assert len(running) == 1, running  # one holder
            d.gateways[running[0]][0].proc.kill()
            other = clients[1 - running[0]]
            done = ended(other, batch.id, timeout=180)
            assert done.status == "completed" and done.request_counts.completed == 24, done
            out = [x["custom_id"] for x in lines_of(other, done.output_file_id)]
            assert sorted(out) == sorted(x["custom_id"] for x in lines)
            assert batch.id in {b.id for b in other.batches.list()}
        assert not (tmp_path / "state" / "tiny-omni" / "batches.sqlite3").exists()  # nothing in SQLite
    finally:
        server.stop()


def test_live_requests_go_before_a_batchs_waiting_lines(demo_dir: Path, tmp_path: Path) -> None:
    """A thinker running one request at a time and a 24-line batch: the gateway lets a line
    through only to a slot of the thinker that is free, so no line waits in the thinker's queue
    (the dozen and more not started wait at the gateway). A live user's request asked while a
    line runs waits there for that one line alone: answered, it finds a few more lines done at
    most, not the dozen and more it would have waited for behind them."""
    pipeline = pipeline_file(tmp_path, one_at_a_time=True, concurrency=24)
    with served(pipeline, demo_dir, tmp_path / "serve.log") as (_, base):
        client = openai_client(base)
        thinker = metrics_urls([base])["thinker-0"]
        # Text only: the thinker alone runs them, so the order it starts them in is the order they end in.
        lines = [chat_line(f"line-{i}", tokens=64, modalities=["text"]) for i in range(24)]
        batch = batch_of(client, lines)
        held = ("omni_gateway_batch_lines_running", "omni_gateway_batch_lines_waiting")
        wait_for(
            lambda: (m := metric_values(f"{base}/metrics", held))[held[0]] == 1 and m[held[1]] >= 12,
            60,
            "a line running and a dozen waiting at the gateway",
        )
        before = client.batches.retrieve(batch.id).request_counts.completed
        live = client.chat.completions.create(
            model="tiny-omni",
            messages=[{"role": "user", "content": "I am here now"}],
            max_tokens=64,
            modalities=["text"],
        )
        assert live.choices[0].message.content
        assert client.batches.retrieve(batch.id).request_counts.completed - before <= 4
        done = ended(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        queued = [
            x.value
            for f in text_string_to_metric_families(HTTP.get(thinker).text)
            for x in f.samples
            if x.name == "omni_stage_admissions_total" and x.labels.get("result") == "queued"
        ]
        assert sum(queued) <= 1, queued  # the live request alone may have waited in its queue
