"""Kubernetes end to end: `omni operator` renders the tiny demo in Distributed mode, and the pods it
asked for serve the official openai client.

No cluster can run here, so two parts are stand-ins (see their docstrings): the API server is
kmock's emulator (tests/kube_api.py), and tests/e2e/kubelet.py plays the kubelet, the Deployment
controller and kube-proxy, running each rendered pod's command and environment as local
processes. Real: the operator process (as the chart runs it), nats-server, mooncake_master and a
store server standing in for their Services, every stage and gateway process.

With KUBECONFIG set, `test_real_cluster` runs against that cluster instead (see
docs/kubernetes.md); it is skipped here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import yaml

from omni_cli.mooncaked import LocalMooncake
from omni_cli.ports import free_port
from tests.e2e.kubelet import Kubelet
from tests.helpers import ROOT, OmniProcess, decode_wav, metric, wait_for
from tests.kube_api import PIPELINE_API, ApiServerThread, Kube
from tests.qwen_reference import media_clips, media_message, reference_with_media

pytestmark = pytest.mark.slow
NS = "omni"


def demo_pipeline(models: Path, mooncake: LocalMooncake) -> dict[str, Any]:
    """examples/tiny-omni-distributed.yaml as a user would adapt it for their cluster: NATS from a
    Secret, the Mooncake Services' addresses, model paths where the pods find them."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-omni-distributed.yaml").read_text())
    spec = doc["spec"]
    spec["nats"] = {"urlSecret": {"name": "omni-nats", "key": "url"}}
    spec["mooncake"].update(masterServerAddress=mooncake.master, metadataServer=mooncake.metadata)
    spec["gateway"]["replicas"] = 1
    for stage in spec["stages"]:
        stage["replicas"] = 1
        engine = stage["engine"]
        if "model" in engine:
            engine["model"] = str(models / Path(engine["model"]).name)
        if "path" in engine.get("args", {}):
            engine["args"]["path"] = str(models / Path(engine["args"]["path"]).name)
    return doc


def ready(kube: Kube, name: str) -> bool:
    cond = kube.condition(NS, name, "Ready")
    return cond is not None and cond["status"] == "True"


@contextlib.contextmanager
def operated(tmp_path: Path, nats_url: str) -> Iterator[Kube]:
    """The API server emulator, `omni operator` against it (as the chart runs it), and the
    Secret a pipeline reads its NATS URL from; the operator must exit cleanly afterwards."""
    kubeconfig = tmp_path / "kubeconfig"
    with ApiServerThread(kubeconfig):
        kube = Kube(kubeconfig)
        operator = OmniProcess(
            ["operator", "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
            tmp_path,
            tmp_path / "operator.log",
            env={"KUBECONFIG": str(kubeconfig)},
        )
        try:
            operator.wait_output("Activity 'login' succeeded", 60)
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "omni-nats"}}
            kube.kind("v1", "Secret").create(body=secret | {"stringData": {"url": nats_url}}, namespace=NS)
            yield kube
        finally:
            assert operator.stop() == 0, operator.output()[-3000:]


def wait_ready(kube: Kube, kubelet: Kubelet, name: str) -> dict[str, Any]:
    """The pipeline's status once it is Ready (what the pods said, if it never is)."""
    try:
        wait_for(lambda: ready(kube, name), 300, "the pipeline to be Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{kubelet.errors}\n{kubelet.logs()}") from None
    return dict(kube.pipeline(NS, name)["status"])


def test_operator_rendered_pods_serve_text_and_audio(
    tmp_path: Path, demo_dir: Path, nats_url: str, mooncake: LocalMooncake
) -> None:
    with operated(tmp_path, nats_url) as kube:
        kube.create(demo_pipeline(demo_dir / "models", mooncake), NS)
        with Kubelet(kube.dyn, NS, tmp_path / "pods") as kubelet:
            status = wait_ready(kube, kubelet, "tiny-omni")
            assert status["stagesReady"] == "3/3"
            assert status["gatewayURL"] == "http://tiny-omni-gateway.omni.svc:8000/v1"

            client = openai.OpenAI(base_url=kubelet.service_url(status["gatewayURL"]), api_key="unused")
            r = client.chat.completions.create(
                model="tiny-omni",
                messages=[{"role": "user", "content": "Hello from the cluster"}],
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
            )
            msg = r.choices[0].message
            assert msg.content and msg.audio is not None
            samples, rate = decode_wav(msg.audio.data)
            assert rate == 24000 and len(samples) == 32 * 4 * 480
            assert not kubelet.errors, kubelet.errors

            pause_the_talker_and_back(kube, kubelet, client)

            # Deleting the pipeline removes its Deployments, and with them the pods.
            kube.kind(PIPELINE_API, "OmniPipeline").delete(name="tiny-omni", namespace=NS)
            wait_for(lambda: not kubelet.alive(), 120, "every pod to stop")
        assert mooncake.key_count() == 0


def split_qwen_omni(models: Path, mooncake: LocalMooncake) -> dict[str, Any]:
    """examples/qwen2.5-omni-epd-distributed.yaml as a user would adapt it to run on CPUs: the
    tiny checkpoint where the pods find it (instead of the 7B on a volume), float32 on the CPU,
    no GPUs, one replica each, the talker's codes capped as in the SingleNode example. The
    encoders' output for the tiny model is kilobytes, so the default connector's inline
    threshold is lowered for it to take Mooncake as a real model's megabytes would."""
    doc = yaml.safe_load((ROOT / "examples" / "qwen2.5-omni-epd-distributed.yaml").read_text())
    spec = doc["spec"]
    spec["nats"] = {"urlSecret": {"name": "omni-nats", "key": "url"}}
    spec["mooncake"].update(masterServerAddress=mooncake.master, metadataServer=mooncake.metadata)
    spec["connectors"]["default"]["inlineThresholdBytes"] = 1024
    spec["gateway"]["replicas"] = 1
    del spec["pods"]
    for stage in spec["stages"]:
        stage.update(replicas=1, resources={})
        stage.pop("autoscaling", None)
        stage["engine"]["model"] = str(models / "tiny-qwen2.5-omni")
        stage["engine"]["args"] = {k: v for k, v in stage["engine"]["args"].items() if k == "part"} | {
            "threads": 1
        }
    spec["stages"][1]["sampling"]["max_tokens"] = 16
    spec["stages"][2]["sampling"]["max_tokens"] = 48
    return doc


def test_split_qwen_omni_pods_answer_an_image_with_text_and_audio(
    tmp_path: Path, demo_dir: Path, nats_url: str, mooncake: LocalMooncake
) -> None:
    """Qwen2.5-Omni with its encoders split out, in Distributed mode: the encoder and the
    thinker are pods of their own Deployments, the embeddings go from one to the other through
    Mooncake (the encoder's put is over the inline threshold, so it is a Mooncake key), and the
    openai client gets the reference's text and audio for a message with an image and a clip."""
    name = "qwen2-5-omni-epd"
    with operated(tmp_path, nats_url) as kube:
        kube.create(split_qwen_omni(demo_dir / "models", mooncake), NS)
        with Kubelet(kube.dyn, NS, tmp_path / "pods") as kubelet:
            status = wait_ready(kube, kubelet, name)
            assert status["stagesReady"] == "4/4"
            (encoder,) = kubelet.pod_urls(f"{name}-encoder")
            (thinker,) = kubelet.pod_urls(f"{name}-thinker")
            assert encoder != thinker

            ref = reference_with_media(demo_dir / "models" / "tiny-qwen2.5-omni", 16, 48, 0, "Chelsie")
            client = openai.OpenAI(base_url=kubelet.service_url(status["gatewayURL"]), api_key="unused")
            r = client.chat.completions.create(
                model="qwen2.5-omni",
                messages=[media_message(*media_clips())],
                modalities=["text", "audio"],
                audio={"voice": "Chelsie", "format": "wav"},
                max_tokens=16,
            )
            msg = r.choices[0].message
            assert msg.content == ref["text"] and msg.audio is not None
            samples, rate = decode_wav(msg.audio.data)
            expected = (np.clip(ref["audio"].numpy(), -1, 1) * 32767).astype(np.int16) / 32768
            assert rate == 24000 and samples.shape == expected.shape
            assert np.abs(samples - expected).max() <= 1 / 32768
            put = metric(f"{encoder}/metrics", "omni_connector_bytes_total", op="put", peer="thinker")
            assert put > 1024
            assert metric(f"{thinker}/metrics", "omni_connector_bytes_total", op="get", peer="encoder") == put
            assert not kubelet.errors, kubelet.errors

            kube.kind(PIPELINE_API, "OmniPipeline").delete(name=name, namespace=NS)
            wait_for(lambda: not kubelet.alive(), 120, "every pod to stop")
        assert mooncake.key_count() == 0


def pause_the_talker_and_back(kube: Kube, kubelet: Kubelet, client: openai.OpenAI) -> None:
    """`spec.stages[].paused` reaches the running pods through the mounted ConfigMap, with no pod
    restarted: the talker sleeps (audio is a 503, text still answers), then wakes."""
    pods = sorted(kubelet.alive())
    quick = client.with_options(max_retries=0)
    spec = kube.pipeline(NS, "tiny-omni")["spec"]

    def speak() -> int:
        try:
            quick.chat.completions.create(
                model="tiny-omni",
                messages=[{"role": "user", "content": "Hello again"}],
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
            )
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    for paused, answer in ((True, 503), (False, 200)):
        spec["stages"][1]["paused"] = paused
        kube.patch_spec(NS, "tiny-omni", spec)
        wait_for(lambda: speak() == answer, 60, f"audio to answer {answer} (paused {paused})")  # noqa: B023
        text = quick.chat.completions.create(model="tiny-omni", messages=[{"role": "user", "content": "Hi"}])
        assert text.choices[0].message.content
        assert sorted(kubelet.alive()) == pods, "a pod was restarted"
    assert ready(kube, "tiny-omni")


@pytest.mark.skipif("KUBECONFIG" not in os.environ, reason="needs a real cluster (KUBECONFIG)")
def test_real_cluster() -> None:
    """Against a real cluster with the chart installed (docs/kubernetes.md): a synthetic pipeline
    (no model files needed in the image) becomes Ready in Distributed mode with the chart's NATS.
    Run with `KUBECONFIG=... OMNI_TEST_NAMESPACE=... [OMNI_TEST_NATS_URL=...]
    pytest tests/e2e/test_kubernetes.py -k real_cluster`."""
    kube = Kube(Path(os.environ["KUBECONFIG"]))
    ns = os.environ.get("OMNI_TEST_NAMESPACE", "default")
    doc = yaml.safe_load((ROOT / "tests" / "data" / "synthetic.yaml").read_text())
    doc["metadata"] = {"name": "omni-e2e"}
    doc["spec"]["mode"] = "Distributed"
    doc["spec"]["connectors"] = {"default": {"kind": "inline"}, "small": {"kind": "inline"}}
    doc["spec"]["nats"] = {
        "url": os.environ.get("OMNI_TEST_NATS_URL", f"nats://omni-pipeline-nats.{ns}.svc:4222")
    }
    kube.create(doc, ns)
    try:
        is_ready = lambda: (kube.condition(ns, "omni-e2e", "Ready") or {}).get("status") == "True"  # noqa: E731
        wait_for(is_ready, 900, "Ready")
    finally:
        kube.kind(PIPELINE_API, "OmniPipeline").delete(name="omni-e2e", namespace=ns)
