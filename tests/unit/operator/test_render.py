"""Rendering (pure): every object valid for Kubernetes (strict), and the parts that matter."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from omni_cli.main import parser
from omni_operator.render import (
    CONFIG_HASH_ANNOTATION,
    GPU_RESOURCE,
    HEALTH_PORT,
    PIPELINE_PATH,
    Names,
    render,
    render_yaml,
)
from omni_pipeline.spec import PipelineFile, load_pipeline, parse_pipeline
from tests.helpers import ROOT

DISTRIBUTED = ROOT / "examples" / "tiny-omni-distributed.yaml"


def pipeline(mutate: Any = None, path: Any = DISTRIBUTED) -> PipelineFile:
    doc = copy.deepcopy(yaml.safe_load(path.read_text()))
    if mutate:
        mutate(doc["spec"])
    return parse_pipeline(doc)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_object_is_valid_kubernetes(example: Any) -> None:
    for obj in render(load_pipeline(example), namespace="omni"):
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_distributed_objects() -> None:
    objects = render(pipeline(), namespace="omni")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "tiny-omni-pipeline"),
        ("Deployment", "tiny-omni-thinker"),
        ("Service", "tiny-omni-thinker"),
        ("Deployment", "tiny-omni-talker"),
        ("Service", "tiny-omni-talker"),
        ("Deployment", "tiny-omni-vocoder"),
        ("Service", "tiny-omni-vocoder"),
        ("Deployment", "tiny-omni-gateway"),
        ("Service", "tiny-omni-gateway"),
    ]
    deployments = by_kind(objects, "Deployment")
    assert deployments["tiny-omni-talker"]["spec"]["replicas"] == 2
    assert deployments["tiny-omni-gateway"]["spec"]["replicas"] == 2
    assert all(o["metadata"]["namespace"] == "omni" for o in objects)


def test_the_configmap_holds_the_pipeline_itself() -> None:
    p = pipeline()
    cm = render(p)[0]
    assert parse_pipeline(yaml.safe_load(cm["data"]["pipeline.yaml"])) == p


def test_stage_command_is_one_omni_understands() -> None:
    c = container(by_kind(render(pipeline()), "Deployment")["tiny-omni-talker"])
    assert c["command"] == ["omni"]
    args = parser().parse_args(c["args"])
    assert (args.cmd, args.pipeline, args.stage, args.replica_id) == (
        "stage",
        PIPELINE_PATH,
        "talker",
        "$(POD_NAME)",
    )
    assert args.metrics_port == HEALTH_PORT
    gw = container(by_kind(render(pipeline()), "Deployment")["tiny-omni-gateway"])
    assert parser().parse_args(gw["args"]).cmd == "gateway"


def test_probes_env_shm_and_labels() -> None:
    d = by_kind(render(pipeline()), "Deployment")["tiny-omni-thinker"]
    c = container(d)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": HEALTH_PORT}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": HEALTH_PORT}
    env = {e["name"]: e for e in c["env"]}
    assert env["OMNI_NATS_URL"]["value"] == "nats://127.0.0.1:4222"
    assert env["OMNI_MOONCAKE_MASTER"]["value"] == "127.0.0.1:50051"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["MC_TCP_BIND_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    selector = d["spec"]["selector"]["matchLabels"]
    assert selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    assert selector == Names("tiny-omni").selector("stage-thinker")


def test_gpus_placement_and_secret() -> None:
    def mutate(s: dict[str, Any]) -> None:
        s["nats"] = {"urlSecret": {"name": "nats-creds", "key": "url"}}
        t = s["stages"][0]
        t["resources"] = {"gpus": 2, "cpu": "4", "memory": "32Gi"}
        t["nodeSelector"] = {"nvidia.com/gpu.product": "H100"}
        t["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

    d = by_kind(render(pipeline(mutate)), "Deployment")["tiny-omni-thinker"]
    c = container(d)
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {GPU_RESOURCE: 2}}
    pod = d["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    env = {e["name"]: e for e in c["env"]}
    assert env["OMNI_NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "nats-creds", "key": "url"}
    talker = container(by_kind(render(pipeline(mutate)), "Deployment")["tiny-omni-talker"])
    assert "limits" not in talker["resources"]


def test_autoscaling_renders_an_hpa_and_leaves_replicas_alone() -> None:
    objects = render(
        pipeline(lambda s: s["stages"][1].update(autoscaling={"minReplicas": 1, "maxReplicas": 6}))
    )
    assert "replicas" not in by_kind(objects, "Deployment")["tiny-omni-talker"]["spec"]
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["tiny-omni-talker"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tiny-omni-talker" and hpa["spec"]["maxReplicas"] == 6
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_keda_autoscaling_renders_a_scaled_object_on_prometheus_instead() -> None:
    keda = {"prometheusAddress": "http://prom:9090", "pollingIntervalSeconds": 5}
    objects = render(
        pipeline(
            lambda s: s["stages"][1].update(autoscaling={"minReplicas": 0, "maxReplicas": 6, "keda": keda})
        ),
        namespace="ml",
    )
    assert "HorizontalPodAutoscaler" not in {o["kind"] for o in objects}
    assert "replicas" not in by_kind(objects, "Deployment")["tiny-omni-talker"]["spec"]
    so = by_kind(objects, "ScaledObject")["tiny-omni-talker"]["spec"]
    assert so["scaleTargetRef"]["name"] == "tiny-omni-talker"
    assert (so["minReplicaCount"], so["maxReplicaCount"], so["pollingInterval"]) == (0, 6, 5)
    (trigger,) = so["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
    assert trigger["metadata"]["serverAddress"] == "http://prom:9090"
    # The stage's queue, by the labels the chart's PodMonitor puts on what it scrapes.
    assert trigger["metadata"]["query"] == (
        'sum(omni_stage_queued_requests{namespace="ml", pipeline="tiny-omni", stage="talker"})'
    )


def test_single_node_is_one_deployment_running_omni_serve() -> None:
    def mutate(s: dict[str, Any]) -> None:
        s["stages"][0]["resources"] = {"gpus": 1}
        s["stages"][1]["resources"] = {"gpus": 2}

    objects = render(pipeline(mutate, ROOT / "examples" / "tiny-omni.yaml"))
    assert [o["kind"] for o in objects] == ["ConfigMap", "Deployment", "Service"]
    c = container(objects[1])
    assert parser().parse_args(c["args"]).cmd == "serve" and c["args"][1] == PIPELINE_PATH
    assert c["resources"]["limits"] == {GPU_RESOURCE: 3}


def test_render_yaml_round_trips() -> None:
    objects = render(pipeline())
    assert list(yaml.safe_load_all(render_yaml(objects))) == objects


def test_pods_section_brings_weights_and_credentials_to_every_pod() -> None:
    def with_pods(spec: dict[str, Any]) -> None:
        spec["pods"] = {
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "models"}}],
            "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
            "serviceAccountName": "omni-pods",
            "imagePullSecrets": ["registry"],
        }

    objects = render(pipeline(with_pods), namespace="omni")
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    for d in by_kind(objects, "Deployment").values():
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        assert {"name": "weights", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
        assert {"name": "weights", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert c["env"][-1]["name"] == "HF_TOKEN" and c["env"][0]["name"] == "POD_NAME"
        assert pod["serviceAccountName"] == "omni-pods" and pod["imagePullSecrets"] == [{"name": "registry"}]


def template_hashes(p: PipelineFile) -> dict[str, str]:
    return {
        name: d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        for name, d in by_kind(render(p), "Deployment").items()
    }


def test_a_spec_change_rolls_the_pods_but_scaling_does_not() -> None:
    """Processes read the pipeline once at start: any change they would read must change every
    pod template; a replica count must not restart other stages."""
    before = template_hashes(pipeline())

    def scale(spec: dict[str, Any]) -> None:
        spec["stages"][1]["replicas"] = 5
        spec["gateway"]["replicas"] = 3
        spec["stages"][2]["autoscaling"] = {"maxReplicas": 4}

    assert template_hashes(pipeline(scale)) == before

    def retune(spec: dict[str, Any]) -> None:
        spec["stages"][0]["engine"]["model"] = "./models/another-thinker"

    after = template_hashes(pipeline(retune))
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)

    single = ROOT / "examples" / "tiny-omni.yaml"
    more = template_hashes(pipeline(lambda s: s["stages"][1].update(replicas=2), single))
    assert more != template_hashes(pipeline(path=single))  # omni serve starts the replicas itself


@pytest.mark.parametrize(
    "path", [DISTRIBUTED, ROOT / "examples" / "tiny-omni.yaml"], ids=["distributed", "single"]
)
def test_pausing_a_stage_changes_its_configmap_and_no_pod_template(path: Any) -> None:
    """The stage processes follow `paused` in the mounted file as the kubelet updates it: the
    ConfigMap carries it, every pod template (and so every pod) stays as it was."""
    awake = render(pipeline(path=path))
    paused = render(pipeline(lambda s: s["stages"][1].update(paused=True), path))
    assert by_kind(paused, "Deployment") == by_kind(awake, "Deployment")
    (cm,) = by_kind(paused, "ConfigMap").values()
    assert yaml.safe_load(cm["data"]["pipeline.yaml"])["spec"]["stages"][1]["paused"] is True


def test_api_keys_reach_only_the_gateway_and_probes_need_none() -> None:
    objects = render(pipeline(lambda s: s["gateway"].update(apiKeysSecret="gw-keys")), namespace="omni")
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)
    deployments = by_kind(objects, "Deployment")
    gw = deployments["tiny-omni-gateway"]
    c = container(gw)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert env["OMNI_API_KEYS_FILE"] == f"{mounts['api-keys']['mountPath']}/keys"
    volumes = {v["name"]: v for v in gw["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "gw-keys"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"  # open with keys on
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    talker = container(deployments["tiny-omni-talker"])
    assert "OMNI_API_KEYS_FILE" not in {e["name"] for e in talker["env"]}


@pytest.mark.parametrize("client_cert", [False, True], ids=["tls", "mutual-tls"])
def test_nats_credentials_and_tls_reach_every_pod(client_cert: bool) -> None:
    def secure(spec: dict[str, Any]) -> None:
        spec["nats"].update(credsSecret="nats-creds", tlsSecret="nats-tls", tlsClientCert=client_cert)

    for p in (pipeline(secure), pipeline(secure, ROOT / "examples" / "tiny-omni.yaml")):
        for dep in by_kind(render(p, namespace="omni"), "Deployment").values():
            kubernetes_validate.validate(dep, "1.33", strict=True)
            c = container(dep)
            env = {e["name"]: e.get("value") for e in c["env"]}
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            volumes = {
                v["name"]: v["secret"] for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v
            }
            assert env["OMNI_NATS_CREDS"] == f"{mounts['nats-creds']}/creds"
            assert env["OMNI_NATS_TLS_CA"] == f"{mounts['nats-tls']}/ca.crt"
            assert ("OMNI_NATS_TLS_CERT" in env) is client_cert and (
                "OMNI_NATS_TLS_KEY" in env
            ) is client_cert
            keys = [i["key"] for i in volumes["nats-tls"]["items"]]
            assert keys == (["ca.crt", "tls.crt", "tls.key"] if client_cert else ["ca.crt"])
            assert volumes["nats-creds"]["secretName"] == "nats-creds"
