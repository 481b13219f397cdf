"""Sleep and wake of stages (vLLM-Omni's POST /v1/omni/sleep and /v1/omni/wakeup) through
`omni serve`, and a stage's `paused` in the pipeline file followed while it runs."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.deployment import Streamed, ask_streaming, gauges, metrics_urls, settle
from tests.helpers import (
    HTTP,
    ROOT,
    openai_client,
    replica_metric,
    replicas,
    served,
    served_example,
    wait_for,
)

pytestmark = pytest.mark.slow

SLOW = ROOT / "tests" / "data" / "slow-synthetic.yaml"


@pytest.fixture(scope="module")
def demo(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_example("tiny-omni.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as base:
        yield base


def _speak(base: str, model: str = "tiny-omni") -> bytes:
    return openai_client(base).audio.speech.create(model=model, input="Good night", voice="alloy").content


def _chat(base: str, **extra: Any) -> Any:
    return openai_client(base).chat.completions.create(
        model="tiny-omni", messages=[{"role": "user", "content": "Good night"}], max_tokens=8, **extra
    )


def _control(base: str, path: str, **body: Any) -> dict[str, Any]:
    r = HTTP.post(f"{base}/v1/omni/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_sleeping_talker_refuses_speech_frees_its_weights_and_wakes_to_the_same_voice(demo: str) -> None:
    """vLLM-Omni's body (a stage id, level 2): the talker drops its weights (its weight gauge
    reads 0 and the ack says how many bytes went, with the process's resident memory before
    and after); speech is a 503 with Retry-After while text-only chat still answers; waking
    loads the weights from the checkpoint again and speech says exactly what it said before."""
    before = _speak(demo)
    weights = replica_metric(demo, "talker", "omni_engine_weight_bytes", device="cpu")
    assert weights > 0

    body = _control(demo, "sleep", stage_ids=[1], level=2)
    (ack,) = body["acks"]
    assert body["status"] == "SUCCESS"
    assert (ack["stage_id"], ack["stage"], ack["level"], ack["freed_bytes"]) == (1, "talker", 2, weights)
    rss = ack["metadata"]
    assert rss["rss_bytes_before"] > 0 and rss["rss_bytes_after"] > 0
    assert replica_metric(demo, "talker", "omni_engine_weight_bytes", device="cpu") == 0
    assert replica_metric(demo, "talker", "omni_stage_sleep_level") == 2
    (talker,) = replicas(demo, "talker")
    ready = HTTP.get(f"http://127.0.0.1:{talker['metrics_port']}/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "sleeping"
    assert HTTP.get(f"{demo}/health").status_code == 200  # the gateway still serves text

    for refused in (lambda: _speak(demo), lambda: _chat(demo, modalities=["text", "audio"])):
        with pytest.raises(openai.APIStatusError) as info:
            refused()
        assert info.value.status_code == 503 and int(info.value.response.headers["retry-after"]) > 0
        assert "stage 'talker' is asleep" in info.value.message
    assert _chat(demo).choices[0].message.content

    body = _control(demo, "wakeup", stage_ids=["talker"])
    assert body["status"] == "SUCCESS" and body["acks"][0]["level"] is None
    assert replica_metric(demo, "talker", "omni_engine_weight_bytes", device="cpu") == weights
    assert _speak(demo) == before
    assert _chat(demo, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}).choices[0]
    assert _control(demo, "wakeup", stage_ids=[1]) == {
        "status": "SKIPPED",
        "reason": "Target stages are not sleeping.",
    }


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"stage_ids": [9]}, 400, "stage_ids"),
        ({"stage_ids": ["nobody"]}, 400, "stage_ids"),
        ({"stage_ids": []}, 400, "stage_ids"),
        ({"stage_ids": [1], "level": 3}, 400, "level"),
        ({"stage_ids": [1], "mode": "keep"}, 400, "mode"),
        ({"stage_ids": [1], "tags": ["weights"]}, 400, "tags"),
    ],
    ids=["unknown-id", "unknown-name", "none", "level", "keep", "unknown-field"],
)
def test_bad_sleep_requests_are_400s_naming_the_field(
    demo: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = HTTP.post(f"{demo}/v1/omni/sleep", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert replicas(demo, "talker")[0]["asleep"] is None


def _stream_then(base: str, act: Callable[[], dict[str, Any]]) -> tuple[Streamed, dict[str, Any]]:
    """A streamed chat with audio (about 4 s on the slow pipeline); `act` runs once its first
    chunk is out, beside the stream."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        wait_for(lambda: replicas(base, "talker"), 30, "the talker")
        talker = metrics_urls([base])["talker-0"]
        acted = pool.submit(
            lambda: (wait_for(lambda: _held(talker) == 1, 30, "the talker to hold it"), act())[1]
        )
        streamed = ask_streaming(base, "a long reply")
        return streamed, acted.result(timeout=60)


def _held(metrics_url: str) -> float:
    text = HTTP.get(metrics_url, timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("omni_stage_tracked"))


def test_a_sleep_lets_what_the_replica_holds_finish_or_aborts_it(tmp_path: Path) -> None:
    """`mode: wait` answers once the request the talker holds has finished, whole; the default
    at levels 1 and 2, `abort`, ends it at once with an error that says why, and every process
    lets go of what it held for it."""
    with served(SLOW, ROOT, tmp_path / "serve.log") as (_, base):
        whole = ask_streaming(base, "a long reply")
        assert whole.error is None and whole.samples > 0
        idle = gauges([base])

        streamed, body = _stream_then(
            base, lambda: _control(base, "sleep", stage_ids=["talker"], mode="wait")
        )
        assert streamed == whole and body["acks"][0]["level"] == 2
        assert "asleep" in ask_streaming(base, "refused").error  # type: ignore[operator]
        _control(base, "wakeup", stage_ids=["talker"])

        streamed, body = _stream_then(base, lambda: _control(base, "sleep", stage_ids=["talker"], level=1))
        assert body["acks"][0]["level"] == 1
        assert streamed.error is not None and "sleep" in streamed.error
        assert streamed.samples < whole.samples
        _control(base, "wakeup", stage_ids=["talker"])
        assert ask_streaming(base, "a long reply") == whole
        settle([base], idle)


def test_paused_in_the_pipeline_file_is_followed_without_a_restart(tmp_path: Path) -> None:
    """A stage `paused` in the file starts asleep; set false (as Kubernetes updates a mounted
    ConfigMap), the same process wakes; set true again, it sleeps."""
    pipeline = tmp_path / "synthetic.yaml"
    doc = yaml.safe_load((ROOT / "tests" / "data" / "synthetic.yaml").read_text())
    doc["spec"]["stages"][1]["paused"] = True

    def write(paused: bool) -> None:
        doc["spec"]["stages"][1]["paused"] = paused
        staged = tmp_path / "staged.yaml"
        staged.write_text(yaml.safe_dump(doc))
        shutil.move(staged, pipeline)  # a new file in its place, as the kubelet's symlink swap

    write(True)
    with served(pipeline, ROOT, tmp_path / "serve.log") as (_, base):
        (talker,) = replicas(base, "talker")
        assert talker["asleep"] == 2
        with pytest.raises(openai.APIStatusError) as info:
            _speak(base, "synth")
        assert info.value.status_code == 503
        write(False)
        wait_for(lambda: replicas(base, "talker")[0]["asleep"] is None, 30, "the talker to wake")
        assert replicas(base, "talker")[0]["pid"] == talker["pid"]
        assert _speak(base, "synth")
        write(True)
        wait_for(lambda: replicas(base, "talker")[0]["asleep"] == 2, 30, "the talker to sleep")
        assert replicas(base, "talker")[0]["pid"] == talker["pid"]
