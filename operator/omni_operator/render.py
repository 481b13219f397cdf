"""Rendering: a pipeline spec -> the Kubernetes objects that serve it. Pure: no API calls.

Distributed: a ConfigMap with the pipeline; per stage a Deployment running `omni stage` (GPU
limits, placement, /dev/shm in memory, probes on the replica's health port, NATS and Mooncake
from the spec or a Secret) and a headless Service for its metrics, plus an HPA when the stage
autoscales (then the Deployment has no `replicas`); the gateway's Deployment and Service.
SingleNode: the ConfigMap, one Deployment running `omni serve` with every stage's GPUs, and
its Service. Every name and label comes from `Names`, so no two places can disagree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

import yaml

from omni_pipeline.environment import MOONCAKE_MASTER_ENV as MASTER_ENV
from omni_pipeline.environment import MOONCAKE_METADATA_ENV as METADATA_ENV
from omni_pipeline.environment import (
    NATS_CREDS_ENV,
    NATS_TLS_CA_ENV,
    NATS_TLS_CERT_ENV,
    NATS_TLS_KEY_ENV,
    NATS_URL_ENV,
)
from omni_pipeline.placement import place
from omni_pipeline.settings import API_KEYS_FILE_ENV, ConnectorKind
from omni_pipeline.spec import REQUEST_SOURCE, AutoscalingSpec, KedaSpec, Mode, PipelineFile, StageSpec

DEFAULT_IMAGE: Final = "ghcr.io/omni-pipeline/omni-pipeline:0.1.0"
PIPELINE_DIR: Final = "/etc/omni"
PIPELINE_PATH: Final = f"{PIPELINE_DIR}/pipeline.yaml"
SECRETS_DIR: Final = "/var/run/omni"
"""Where Secrets the pods read as files are mounted, one directory per volume."""
HEALTH_PORT: Final = 9090
GPU_RESOURCE: Final = "nvidia.com/gpu"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "omni-operator"
RUN_AS: Final = 10001
"""The image's non-root uid and gid (Dockerfile `USER`)."""
CONFIG_HASH_ANNOTATION: Final = "omnipipeline.dev/config-hash"
STARTUP_WINDOW_S: Final = 600
"""How long a replica may take to load its model before Kubernetes restarts it."""


@dataclass(frozen=True)
class Names:
    """Every object name and label of one pipeline."""

    pipeline: str

    @property
    def configmap(self) -> str:
        return f"{self.pipeline}-pipeline"

    def stage(self, stage: str) -> str:
        return f"{self.pipeline}-{stage}"

    @property
    def gateway(self) -> str:
        return f"{self.pipeline}-gateway"

    @property
    def single_node(self) -> str:
        return f"{self.pipeline}-omni"

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "omni-pipeline",
            INSTANCE_LABEL: self.pipeline,
            COMPONENT_LABEL: component,
            MANAGED_BY_LABEL: MANAGED_BY,
        }

    def selector(self, component: str) -> dict[str, str]:
        labels = self.labels(component)
        return {k: labels[k] for k in (INSTANCE_LABEL, COMPONENT_LABEL)}


def config_hash(p: PipelineFile) -> str:
    """What a running process read from the pipeline at start, hashed: a change rolls the pods.

    Processes read the pipeline file once, so a changed ConfigMap alone would leave them on the
    old spec. Replica counts are left out in Distributed mode (no process reads another stage's),
    so scaling one stage restarts nothing; `omni serve` starts the replicas itself, so there
    they count. A stage's `paused` is left out in both: stage processes follow it in the
    mounted file as the kubelet updates it, without a restart.
    """
    doc = p.model_dump(by_alias=True, exclude_none=True, mode="json")
    for stage in doc["spec"]["stages"]:
        stage.pop("paused", None)
    if p.spec.mode is Mode.DISTRIBUTED:
        doc["spec"]["gateway"].pop("replicas", None)
        for stage in doc["spec"]["stages"]:
            stage.pop("replicas", None)
            stage.pop("autoscaling", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def pipeline_yaml(p: PipelineFile) -> str:
    return yaml.safe_dump(p.model_dump(by_alias=True, exclude_none=True, mode="json"), sort_keys=False)


def unservable(p: PipelineFile) -> list[str]:
    """What a valid pipeline file asks that pods cannot do. Each stage replica of a Distributed
    pipeline has its own pod, hence its own /dev/shm: a shm edge between two stages would fail on
    the first request, so it is refused up front."""
    if p.spec.mode is not Mode.DISTRIBUTED:
        return []
    return [
        f"stage '{s.name}': inputs[{i}].connector: '{e.connector}' is shared memory, which cannot "
        "cross pods in Distributed mode; use a mooncake or inline connector"
        for s in p.spec.stages
        for i, e in enumerate(s.inputs)
        if e.from_ != REQUEST_SOURCE and p.spec.connectors[e.connector].kind is ConnectorKind.SHM
    ]


def render(p: PipelineFile, namespace: str = "default", image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """All objects for `p`, in apply order."""
    names = Names(p.name)
    image = p.spec.image or image
    objects = [_configmap(p, names, namespace)]
    if p.spec.mode is Mode.SINGLE_NODE:
        return [*objects, *_single_node(p, names, namespace, image)]
    for stage in p.spec.stages:
        objects += _stage(p, stage, names, namespace, image)
    return [*objects, *_gateway(p, names, namespace, image)]


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _configmap(p: PipelineFile, names: Names, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(names.configmap, namespace, names.labels("config")),
        "data": {"pipeline.yaml": pipeline_yaml(p)},
    }


def _env(p: PipelineFile) -> list[dict[str, Any]]:
    return [*_omni_env(p), *p.spec.pods.env]


def _omni_env(p: PipelineFile) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MC_TCP_BIND_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    nats = p.spec.nats
    if nats.url_secret is not None:
        ref = {"name": nats.url_secret.name, "key": nats.url_secret.key}
        env.append({"name": NATS_URL_ENV, "valueFrom": {"secretKeyRef": ref}})
    elif nats.url:
        env.append({"name": NATS_URL_ENV, "value": nats.url})
    if (mc := p.spec.mooncake) is not None:
        if mc.master_server_address:
            env.append({"name": MASTER_ENV, "value": mc.master_server_address})
        if mc.metadata_server:
            env.append({"name": METADATA_ENV, "value": mc.metadata_server})
    return env


def _probe(path: str, port: int, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "failureThreshold": failures}


def _container(
    p: PipelineFile,
    name: str,
    image: str,
    args: list[str],
    port: int,
    live: str,
    ready: str,
    resources: dict[str, Any],
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "command": ["omni"],
        "args": args,
        "env": _env(p),
        "ports": [{"name": "http", "containerPort": port}],
        "startupProbe": _probe(live, port, 5, STARTUP_WINDOW_S // 5),
        "livenessProbe": _probe(live, port, 10, 3),
        "readinessProbe": _probe(ready, port, 5, 2),
        "resources": resources,
        "volumeMounts": [
            {"name": "pipeline", "mountPath": PIPELINE_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *p.spec.pods.volume_mounts,
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _pod(
    p: PipelineFile, names: Names, component: str, container: dict[str, Any], stage: StageSpec | None
) -> dict[str, Any]:
    pods = p.spec.pods
    spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {"name": "pipeline", "configMap": {"name": names.configmap}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *pods.volumes,
        ],
    }
    if pods.service_account_name:
        spec["serviceAccountName"] = pods.service_account_name
    if pods.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in pods.image_pull_secrets]
    if stage is not None:
        if stage.node_selector:
            spec["nodeSelector"] = dict(stage.node_selector)
        if stage.tolerations:
            spec["tolerations"] = list(stage.tolerations)
        if stage.affinity:
            spec["affinity"] = dict(stage.affinity)
    meta = {"labels": names.labels(component), "annotations": {CONFIG_HASH_ANNOTATION: config_hash(p)}}
    return _with_nats_secrets(p, {"metadata": meta, "spec": spec})


def _with_secret_files(
    pod: dict[str, Any], volume: str, secret: str, files: dict[str, str]
) -> dict[str, Any]:
    """Mount `files` (Secret key -> the env var that names its path) of `secret` read-only
    under /var/run/omni/<volume>."""
    directory = f"{SECRETS_DIR}/{volume}"
    container = pod["spec"]["containers"][0]
    container["env"].extend({"name": k, "value": f"{directory}/{key}"} for key, k in files.items())
    container["volumeMounts"].append({"name": volume, "mountPath": directory, "readOnly": True})
    items = [{"key": key, "path": key} for key in files]
    pod["spec"]["volumes"].append(
        {"name": volume, "secret": {"secretName": secret, "items": items, "defaultMode": 0o440}}
    )
    return pod


def _with_nats_secrets(p: PipelineFile, pod: dict[str, Any]) -> dict[str, Any]:
    """Every pod talks to NATS: the credentials file and TLS files of spec.nats, if any."""
    nats = p.spec.nats
    if nats.creds_secret is not None:
        _with_secret_files(pod, "nats-creds", nats.creds_secret, {"creds": NATS_CREDS_ENV})
    if nats.tls_secret is not None:
        files = {"ca.crt": NATS_TLS_CA_ENV}
        if nats.tls_client_cert:
            files |= {"tls.crt": NATS_TLS_CERT_ENV, "tls.key": NATS_TLS_KEY_ENV}
        _with_secret_files(pod, "nats-tls", nats.tls_secret, files)
    return pod


def _with_api_keys(p: PipelineFile, pod: dict[str, Any]) -> dict[str, Any]:
    """The gateway's pod reads its API keys from spec.gateway.apiKeysSecret's `keys` entry."""
    if (secret := p.spec.gateway.api_keys_secret) is None:
        return pod
    return _with_secret_files(pod, "api-keys", secret, {"keys": API_KEYS_FILE_ENV})


def _deployment(
    names: Names, name: str, component: str, namespace: str, replicas: int | None, pod: dict[str, Any]
) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": names.selector(component)}, "template": pod}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, names.labels(component)),
        "spec": spec,
    }


def _service(
    names: Names, name: str, component: str, namespace: str, port: int, headless: bool
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": names.selector(component),
        "ports": [{"name": "http", "port": port, "targetPort": "http"}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, names.labels(component)),
        "spec": spec,
    }


def _resources(gpus: int, cpu: str | None, memory: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
    if requests:
        out["requests"] = requests
    if gpus:
        out["limits"] = {GPU_RESOURCE: gpus}
    return out


def _stage(
    p: PipelineFile, stage: StageSpec, names: Names, namespace: str, image: str
) -> list[dict[str, Any]]:
    component = f"stage-{stage.name}"
    name = names.stage(stage.name)
    args = [
        "stage",
        "--pipeline",
        PIPELINE_PATH,
        "--stage",
        stage.name,
        "--replica-id",
        "$(POD_NAME)",
        "--metrics-host",
        "0.0.0.0",
        "--metrics-port",
        str(HEALTH_PORT),
    ]
    r = stage.resources
    container = _container(
        p,
        "stage",
        image,
        args,
        HEALTH_PORT,
        "/health/live",
        "/health/ready",
        _resources(r.gpus, r.cpu, r.memory),
    )
    replicas = None if stage.autoscaling is not None else stage.replicas
    out = [
        _deployment(
            names,
            name,
            component,
            namespace,
            replicas,
            _pod(p, names, component, container, stage),
        ),
        _service(names, name, component, namespace, HEALTH_PORT, headless=True),
    ]
    if (a := stage.autoscaling) is not None and a.keda is not None:
        out.append(_scaled_object(p, names, name, component, namespace, stage.name, a, a.keda))
    elif a is not None:
        out.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(name, namespace, names.labels(component)),
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                    "minReplicas": max(1, a.min_replicas),
                    "maxReplicas": a.max_replicas,
                    "metrics": [
                        {
                            "type": "Pods",
                            "pods": {
                                "metric": {"name": a.metric},
                                "target": {"type": "AverageValue", "averageValue": a.target_average_value},
                            },
                        }
                    ],
                },
            }
        )
    return out


def _scaled_object(
    p: PipelineFile,
    names: Names,
    name: str,
    component: str,
    namespace: str,
    stage: str,
    a: AutoscalingSpec,
    keda: KedaSpec,
) -> dict[str, Any]:
    """KEDA's ScaledObject for a stage: its Prometheus scaler keeps the query's value per replica
    at targetAverageValue (it makes and drives an HPA of its own)."""
    query = keda.query or f'sum({a.metric}{{namespace="{namespace}", pipeline="{p.name}", stage="{stage}"}})'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(name, namespace, names.labels(component)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": keda.polling_interval_s,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": keda.prometheus_address,
                        "query": query,
                        "threshold": a.target_average_value,
                    },
                }
            ],
        },
    }


def _gateway(p: PipelineFile, names: Names, namespace: str, image: str) -> list[dict[str, Any]]:
    port = p.spec.gateway.port or 8000
    args = ["gateway", "--pipeline", PIPELINE_PATH, "--host", "0.0.0.0", "--port", str(port)]
    container = _container(p, "gateway", image, args, port, "/health/live", "/health", {})
    pod = _with_api_keys(p, _pod(p, names, "gateway", container, None))
    return [
        _deployment(names, names.gateway, "gateway", namespace, p.spec.gateway.replicas, pod),
        _service(names, names.gateway, "gateway", namespace, port, headless=False),
    ]


def _single_node(p: PipelineFile, names: Names, namespace: str, image: str) -> list[dict[str, Any]]:
    port = p.spec.gateway.port or 8000
    gpus = place(p.spec).device_count  # shared devices count once
    args = ["serve", PIPELINE_PATH, "--host", "0.0.0.0", "--port", str(port)]
    container = _container(
        p, "omni", image, args, port, "/health/live", "/health", _resources(gpus, None, None)
    )
    pod = _with_api_keys(p, _pod(p, names, "single-node", container, None))
    return [
        _deployment(names, names.single_node, "single-node", namespace, 1, pod),
        _service(names, names.single_node, "single-node", namespace, port, headless=False),
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded pipeline) as literal blocks, readable in kubectl output."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def render_yaml(objects: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False) for o in objects)
