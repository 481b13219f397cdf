"""Two operator replicas with leader election, as the chart runs them: `omni operator
--leader-election` processes against the emulated API server (tests/kube_api.py, which keeps the
Lease and refuses a stale replace of it as the API server does; no cluster can run here). One
leads and reconciles, the other waits and answers its liveness probe; killing the leader
outright (SIGKILL: no goodbye) hands reconciling to the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_cli.ports import free_port
from omni_operator.handlers import IMAGE_ENV, LEASE_NAME, RESYNC_ENV
from tests.helpers import HTTP, ROOT, OmniProcess, wait_for
from tests.kube_api import ApiServerThread, Kube, pipeline_body

LEASE_NS = "omni-system"


class Replica:
    def __init__(self, name: str, kubeconfig: Path, logs: Path) -> None:
        self.name = name
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        env = {"KUBECONFIG": str(kubeconfig), IMAGE_ENV: "registry.example/omni:test", RESYNC_ENV: "3600"}
        args = ["operator", "--leader-election", "--lease-namespace", LEASE_NS, "--liveness", self.liveness]
        self.process = OmniProcess(args, ROOT, logs / f"{name}.log", {**env, "POD_NAME": name})


def holder(kube: Kube) -> str:
    lease = kube.get("coordination.k8s.io/v1", "Lease", LEASE_NS, LEASE_NAME) or {}
    return str(lease.get("spec", {}).get("holderIdentity", ""))


def reconciled(kube: Kube, ns: str, name: str) -> bool:
    return f"{name}-talker" in kube.names("apps/v1", "Deployment", ns)


@pytest.mark.slow
def test_one_replica_leads_and_the_other_takes_over_when_it_dies(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    with ApiServerThread(kubeconfig) as server:
        kube = Kube(kubeconfig, server)
        a = Replica("op-a", kubeconfig, tmp_path)
        b = None
        try:
            a.process.wait_output("leading", 60)
            b = Replica("op-b", kubeconfig, tmp_path)
            b.process.wait_output("waiting to lead", 60)
            assert holder(kube).startswith("op-a-")
            kube.create(pipeline_body("first"), "ml")
            wait_for(lambda: reconciled(kube, "ml", "first"), 30, "the leader to reconcile")
            # The standby: alive, not leading, and nothing of kopf running in it.
            assert HTTP.get(b.liveness, timeout=5).status_code == 200
            assert "operator op-b" in b.process.output() and "leading\n" not in b.process.output()
            assert "kopf" not in b.process.output()

            a.process.proc.kill()
            b.process.wait_output("operator op-b", 5)
            wait_for(lambda: holder(kube).startswith("op-b-"), 60, "the standby to take the lease")
            kube.create(pipeline_body("second"), "ml")
            wait_for(lambda: reconciled(kube, "ml", "second"), 30, "the new leader to reconcile")
            assert HTTP.get(b.liveness, timeout=5).status_code == 200  # now kopf's own
        finally:
            a.process.stop()
            if b is not None:
                assert b.process.stop() == 0, b.process.output()[-3000:]
