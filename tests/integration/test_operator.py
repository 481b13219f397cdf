"""The kopf operator against an emulated Kubernetes API (kmock; see tests/kube_api.py for what it
adds). No cluster runs here, so the test plays the Deployment controller where a rollout matters:
it writes Deployment status the way kube-controller-manager would. Everything else (kopf's
watches, the operator's server-side applies, status patches) goes over HTTP to the emulator.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner

from omni_cli.ports import free_port
from omni_operator.cluster import FIELD_MANAGER
from omni_operator.handlers import IMAGE_ENV, METRICS_PORT_ENV, RESYNC_ENV
from omni_operator.render import CONFIG_HASH_ANNOTATION
from tests.helpers import ROOT, metric, metric_families, wait_for
from tests.kube_api import PIPELINE_API, ApiServerThread, Kube, discovery_cache, pipeline_body

IMAGE = "registry.example/omni:test"


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The operator's /metrics port, picked when its module starts (picked at import, every
    worker of a run held one for the run without serving it)."""
    return free_port()


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, metrics_port: int) -> Iterator[Kube]:
    """An emulated API server and the operator (kopf in its own thread, logged in through our
    `@kopf.on.login`, which reads the same kubeconfig as the test's client)."""
    kubeconfig = tmp_path_factory.mktemp("kube") / "kubeconfig"
    with ApiServerThread(kubeconfig) as server, pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(kubeconfig))
        mp.setenv(IMAGE_ENV, IMAGE)
        mp.setenv(RESYNC_ENV, "3600")
        mp.setenv(METRICS_PORT_ENV, str(metrics_port))
        args = ["run", "--standalone", "--all-namespaces", "-m", "omni_operator.handlers"]
        with KopfRunner(args, timeout=60) as runner:
            yield Kube(kubeconfig, server)
        assert runner.exception is None, runner.output
        cache = discovery_cache(server.url)
        assert cache.exists()  # the server's exit removes what its clients wrote, not another file
    assert not cache.exists()


def children(kube: Kube, ns: str) -> dict[str, set[str]]:
    return {
        "Deployment": kube.names("apps/v1", "Deployment", ns),
        "Service": kube.names("v1", "Service", ns),
        "ConfigMap": kube.names("v1", "ConfigMap", ns),
        "HorizontalPodAutoscaler": kube.names("autoscaling/v2", "HorizontalPodAutoscaler", ns),
        "ScaledObject": kube.names("keda.sh/v1alpha1", "ScaledObject", ns),
    }


ALL_DEPLOYMENTS = {"p-thinker", "p-talker", "p-vocoder", "p-gateway"}


def test_create_makes_owned_children_and_reports_status(kube: Kube) -> None:
    ns = "create"
    created = kube.create(pipeline_body("p"), ns)
    uid = created["metadata"]["uid"]
    wait_for(lambda: children(kube, ns)["Deployment"] == ALL_DEPLOYMENTS, 30, "the Deployments")
    found = children(kube, ns)
    assert found["Service"] == ALL_DEPLOYMENTS and found["ConfigMap"] == {"p-pipeline"}
    for kind, api in (("Deployment", "apps/v1"), ("Service", "v1")):
        for name in found[kind]:
            refs = kube.get(api, kind, ns, name)["metadata"]["ownerReferences"]  # type: ignore[index]
            assert refs == [
                {
                    "apiVersion": PIPELINE_API,
                    "kind": "OmniPipeline",
                    "name": "p",
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
    talker = kube.get("apps/v1", "Deployment", ns, "p-talker")
    container = talker["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert container["image"] == IMAGE
    assert {"name": "OMNI_NATS_URL", "value": "nats://nats.omni.svc:4222"} in container["env"]

    status = wait_for(lambda: kube.pipeline(ns, "p").get("status", {}).get("gatewayURL"), 30, "status")
    assert status == "http://p-gateway.create.svc:8000/v1"
    status = kube.pipeline(ns, "p")["status"]
    assert status["observedGeneration"] == 1 and status["stagesReady"] == "0/3"
    assert [s["name"] for s in status["stages"]] == ["thinker", "talker", "vocoder"]
    ready = kube.condition(ns, "p", "Ready")
    assert ready is not None and ready["status"] == "False" and "thinker 0/1 available" in ready["message"]


def test_ready_only_after_every_deployment_rolled_out_this_generation(kube: Kube) -> None:
    ns = "ready"
    body = pipeline_body("p")
    kube.create(body, ns)
    wait_for(lambda: children(kube, ns)["Deployment"] == ALL_DEPLOYMENTS, 30, "the Deployments")
    for name in ("p-thinker", "p-talker", "p-gateway"):
        kube.roll_out(ns, name)
    kube.roll_out(ns, "p-vocoder", ready=0)
    wait_for(lambda: kube.pipeline(ns, "p")["status"].get("stagesReady") == "2/3", 30, "2 of 3 stages")
    assert kube.condition(ns, "p", "Ready")["status"] == "False"  # type: ignore[index]
    kube.roll_out(ns, "p-vocoder")
    wait_for(lambda: kube.condition(ns, "p", "Ready")["status"] == "True", 30, "Ready")  # type: ignore[index]
    assert kube.pipeline(ns, "p")["status"]["stagesReady"] == "3/3"

    # A new spec: the talker Deployment gets a new generation; Ready waits for its rollout.
    spec = copy.deepcopy(body["spec"])
    spec["stages"][1]["replicas"] = 3
    kube.patch_spec(ns, "p", spec)
    talker_at_gen2 = lambda: kube.get("apps/v1", "Deployment", ns, "p-talker")["spec"]["replicas"] == 3  # noqa: E731
    wait_for(talker_at_gen2, 30, "talker scaled to 3")
    wait_for(lambda: kube.pipeline(ns, "p")["status"]["observedGeneration"] == 2, 30, "generation 2")
    ready = kube.condition(ns, "p", "Ready")
    assert ready["status"] == "False" and "talker 1/3 available" in ready["message"]  # type: ignore[index]
    kube.roll_out(ns, "p-talker")
    wait_for(lambda: kube.condition(ns, "p", "Ready")["status"] == "True", 30, "Ready again")  # type: ignore[index]


def test_update_changes_children_and_removing_a_stage_prunes_it(kube: Kube) -> None:
    ns = "update"
    body = pipeline_body("p")
    kube.create(body, ns)
    wait_for(lambda: children(kube, ns)["Deployment"] == ALL_DEPLOYMENTS, 30, "the Deployments")

    def deployment(name: str) -> dict[str, Any]:
        d = kube.get("apps/v1", "Deployment", ns, name)
        assert d is not None
        return d

    def template_hash(name: str) -> str:
        return deployment(name)["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    first = {name: template_hash(name) for name in ALL_DEPLOYMENTS}
    talker_generation = deployment("p-talker")["metadata"]["generation"]

    # Scaling one stage changes that Deployment only: no other pod restarts.
    spec = copy.deepcopy(body["spec"])
    spec["stages"][0]["replicas"] = 2
    kube.patch_spec(ns, "p", spec)
    wait_for(lambda: deployment("p-thinker")["spec"]["replicas"] == 2, 30, "thinker replicas 2")
    wait_for(lambda: kube.pipeline(ns, "p")["status"]["observedGeneration"] == 2, 30, "generation 2")
    assert {name: template_hash(name) for name in ALL_DEPLOYMENTS} == first
    assert deployment("p-talker")["metadata"]["generation"] == talker_generation

    # A new engine setting reaches the ConfigMap and rolls every pod (they read it at start).
    spec = copy.deepcopy(spec)
    spec["stages"][0]["engine"]["args"]["msPerUnit"] = 7
    kube.patch_spec(ns, "p", spec)
    wait_for(
        lambda: "msPerUnit: 7" in kube.get("v1", "ConfigMap", ns, "p-pipeline")["data"]["pipeline.yaml"],  # type: ignore[index]
        30,
        "the new engine args in the ConfigMap",
    )
    rolled = lambda: all(template_hash(n) != first[n] for n in ALL_DEPLOYMENTS)  # noqa: E731
    wait_for(rolled, 30, "every pod template changed")
    assert deployment("p-talker")["metadata"]["generation"] == talker_generation + 1

    # Drop the talker; the vocoder now reads the thinker.
    spec = copy.deepcopy(spec)
    del spec["stages"][1]
    spec["stages"][1]["inputs"] = [{"from": "thinker", "window": 16}]
    kube.patch_spec(ns, "p", spec)
    wait_for(lambda: "p-talker" not in children(kube, ns)["Deployment"], 30, "talker Deployment pruned")
    found = children(kube, ns)
    assert found["Deployment"] == {"p-thinker", "p-vocoder", "p-gateway"}
    assert found["Service"] == {"p-thinker", "p-vocoder", "p-gateway"}


def talker_replicas(kube: Kube, ns: str) -> list[int]:
    """Every `replicas` the talker's Deployment has had, in order, repeats dropped."""
    seen: list[int] = []
    for version in kube.server.versions("apps/v1/deployments", ns, "p-talker"):
        if not seen or seen[-1] != version["spec"]["replicas"]:
            seen.append(version["spec"]["replicas"])
    return seen


def owns_replicas(deployment: dict[str, Any], manager: str) -> bool:
    return any(
        e["manager"] == manager and "f:replicas" in e.get("fieldsV1", {}).get("f:spec", {})
        for e in deployment["metadata"].get("managedFields") or []
    )


def test_autoscaling_takes_replicas_over_without_a_dip_and_gives_them_back(kube: Kube) -> None:
    """Under server-side apply (tests/kube_fields.py: field ownership as the API server keeps
    it), turning autoscaling on must not release `replicas` to the API server's default of 1,
    the operator must never undo what the autoscaler set, and turning it off takes it back."""
    ns = "hpa"
    body = pipeline_body("p")
    body["spec"]["stages"][1]["replicas"] = 3
    kube.create(body, ns)
    talker = lambda: kube.get("apps/v1", "Deployment", ns, "p-talker")  # noqa: E731
    wait_for(lambda: (talker() or {}).get("spec", {}).get("replicas") == 3, 30, "talker at 3")

    spec = copy.deepcopy(body["spec"])
    spec["stages"][1]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 6}
    kube.patch_spec(ns, "p", spec)
    wait_for(lambda: children(kube, ns)["HorizontalPodAutoscaler"] == {"p-talker"}, 30, "the HPA")
    wait_for(lambda: not owns_replicas(talker(), FIELD_MANAGER), 30, "the operator to let go of replicas")
    assert talker()["spec"]["replicas"] == 3  # held at its value for the autoscaler: no dip

    # The autoscaler acts: its writes (through the scale subresource) are updates of its own.
    kube.kind("apps/v1", "Deployment").patch(
        body={"spec": {"replicas": 5}},
        name="p-talker",
        namespace=ns,
        content_type="application/merge-patch+json",
        field_manager="horizontal-pod-autoscaler",
    )
    # The operator applies the talker again (its template changes) and leaves the count alone.
    spec["stages"][1]["maxInflight"] = 6
    kube.patch_spec(ns, "p", spec)
    generation = kube.pipeline(ns, "p")["metadata"]["generation"]
    wait_for(
        lambda: (kube.pipeline(ns, "p").get("status") or {}).get("observedGeneration") == generation,
        30,
        "the new spec applied",
    )
    assert talker()["spec"]["replicas"] == 5

    # Autoscaling off: the count is the spec's again, and the HPA goes.
    del spec["stages"][1]["autoscaling"]
    spec["stages"][1]["replicas"] = 4
    kube.patch_spec(ns, "p", spec)
    wait_for(lambda: not children(kube, ns)["HorizontalPodAutoscaler"], 30, "the HPA pruned")
    wait_for(lambda: talker()["spec"]["replicas"] == 4, 30, "talker at 4")
    assert owns_replicas(talker(), FIELD_MANAGER)
    assert talker_replicas(kube, ns) == [3, 5, 4]


KEDA = {"prometheusAddress": "http://prometheus-operated.monitoring:9090"}


@pytest.mark.parametrize(("autoscaler", "keda"), [("HorizontalPodAutoscaler", None), ("ScaledObject", KEDA)])
def test_a_new_autoscaled_stage_starts_at_its_floor(
    kube: Kube, autoscaler: str, keda: dict[str, str] | None
) -> None:
    ns = f"new-{autoscaler.lower()}"
    body = pipeline_body("p")
    body["spec"]["stages"][1]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 4, "keda": keda}
    kube.create(body, ns)
    wait_for(lambda: children(kube, ns)[autoscaler] == {"p-talker"}, 30, f"the {autoscaler}")
    other = "ScaledObject" if keda is None else "HorizontalPodAutoscaler"
    assert children(kube, ns)[other] == set()
    # A later apply (any spec change) drops the operator's claim; the count stays at the floor.
    spec = copy.deepcopy(body["spec"])
    spec["stages"][1]["maxInflight"] = 6
    kube.patch_spec(ns, "p", spec)
    talker = lambda: kube.get("apps/v1", "Deployment", ns, "p-talker")  # noqa: E731
    wait_for(lambda: not owns_replicas(talker(), FIELD_MANAGER), 30, "the operator to let go of replicas")
    assert talker_replicas(kube, ns) == [2]  # never 1, never anything else


def shm_edge(spec: dict[str, Any]) -> None:
    spec["connectors"]["local"] = {"kind": "shm"}
    spec["stages"][1]["inputs"][0]["connector"] = "local"


@pytest.mark.parametrize(
    ("breakage", "named"),
    [
        (lambda spec: spec["stages"][1].update(inputs=[{"from": "nosuchstage"}]), "nosuchstage"),
        (lambda spec: spec["stages"][1].update(inputs=[{"from": "vocoder", "window": 8}]), "cycle"),
        (shm_edge, "cannot cross pods"),
    ],
    ids=["unknown-from", "cycle", "shm-across-pods"],
)
def test_invalid_spec_reports_and_creates_nothing(
    kube: Kube, breakage: Callable[[dict[str, Any]], None], named: str
) -> None:
    ns = "invalid-" + re.sub(r"[^a-z]+", "-", named)
    body = pipeline_body("p")
    breakage(body["spec"])
    kube.create(body, ns)
    cond = wait_for(lambda: kube.condition(ns, "p", "InvalidSpec"), 30, "InvalidSpec")
    assert cond["status"] == "True" and named in cond["message"] and "talker" in cond["message"]
    assert kube.condition(ns, "p", "Ready")["status"] == "False"  # type: ignore[index]
    assert all(not names for names in children(kube, ns).values())


def test_deleted_child_is_put_back(kube: Kube) -> None:
    ns = "drift"
    kube.create(pipeline_body("p"), ns)
    wait_for(lambda: children(kube, ns)["Deployment"] == ALL_DEPLOYMENTS, 30, "the Deployments")
    first = kube.get("apps/v1", "Deployment", ns, "p-talker")["metadata"]["uid"]  # type: ignore[index]
    kube.kind("apps/v1", "Deployment").delete(name="p-talker", namespace=ns)

    def recreated() -> bool:
        d = kube.get("apps/v1", "Deployment", ns, "p-talker")
        return d is not None and d["metadata"]["uid"] != first

    wait_for(recreated, 30, "the talker Deployment re-created")


def test_delete_removes_children_and_leaves_no_finalizer(kube: Kube) -> None:
    ns = "delete"
    kube.create(pipeline_body("p"), ns)
    wait_for(lambda: children(kube, ns)["Deployment"] == ALL_DEPLOYMENTS, 30, "the Deployments")
    wait_for(lambda: kube.pipeline(ns, "p").get("status"), 30, "a status")
    assert not kube.pipeline(ns, "p")["metadata"].get("finalizers")
    kube.kind(PIPELINE_API, "OmniPipeline").delete(name="p", namespace=ns)
    assert kube.get(PIPELINE_API, "OmniPipeline", ns, "p") is None  # no finalizer held it
    wait_for(lambda: all(not names for names in children(kube, ns).values()), 30, "children gone")


def test_a_child_applied_after_its_pipeline_was_deleted_is_collected(kube: Kube) -> None:
    """A reconcile that read the pipeline just before it was deleted applies its children after:
    created for an owner already gone, the cluster's garbage collector deletes them (the API
    emulator does as it does), so deleting a pipeline never leaves pods running."""
    owner = {"apiVersion": PIPELINE_API, "kind": "OmniPipeline", "name": "gone", "uid": "no-such-uid"}
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "late", "ownerReferences": [owner]},
        "data": {"k": "v"},
    }
    kube.kind("v1", "ConfigMap").create(body=body, namespace="late")
    assert kube.get("v1", "ConfigMap", "late", "late") is None


def test_the_operator_counts_its_reconciles_and_pipelines_by_condition(kube: Kube, metrics_port: int) -> None:
    ns = "metrics"
    url = f"http://127.0.0.1:{metrics_port}/metrics"

    def operator_metric(name: str, **labels: str) -> float:
        return metric(url, name, **labels)

    applied = operator_metric("omni_operator_reconciles_total", result="applied")
    invalid = operator_metric("omni_operator_reconciles_total", result="invalid_spec")
    kube.create(pipeline_body("good"), ns)
    bad = pipeline_body("bad")
    bad["spec"]["stages"][1]["inputs"] = [{"from": "nosuchstage"}]
    kube.create(bad, ns)
    wait_for(lambda: kube.condition(ns, "bad", "InvalidSpec") is not None, 30, "bad's InvalidSpec")
    wait_for(lambda: kube.condition(ns, "good", "Ready") is not None, 30, "good's Ready")
    assert operator_metric("omni_operator_reconciles_total", result="applied") > applied
    assert operator_metric("omni_operator_reconciles_total", result="invalid_spec") == invalid + 1
    assert operator_metric("omni_operator_reconcile_seconds_count") >= 2
    assert operator_metric("omni_operator_pipelines", condition="InvalidSpec", status="True") >= 1
    assert operator_metric("omni_operator_pipelines", condition="Ready", status="False") >= 2
    # docs/observability.md names exactly what it exports.
    families = metric_families(url)
    exported = {name for name in families if name.startswith("omni_")}
    documented = re.findall(r"`(omni_operator_[a-z_]+)`", (ROOT / "docs" / "observability.md").read_text())
    assert exported == {n.removesuffix("_total") for n in documented}
