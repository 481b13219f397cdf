"""A stand-in for the kubelet, the Deployment controller and kube-proxy, for one namespace.

Fake on purpose: no cluster can run here. For every Deployment in the API server it runs the
pod's container as local processes, from the rendered command, args and environment and
nothing else: the image is replaced by the local venv (PATH; `omni stage`, `gateway` and
`serve` are forked from the tests' server with that argv, environment and directory, as
OmniProcess forks them: the same main without importing torch again), `$(VAR)` references
are expanded as the kubelet expands them, and env `valueFrom` is resolved from the pod (name,
IP), Secrets and ConfigMaps read through the API. What a pod's namespaces would give it is emulated: each
pod gets its own loopback address (127.0.0.N) as its IP, so `0.0.0.0` in its args means that
address (the pod's network namespace); a volume's mountPath in the args means the directory
holding that volume's files (its mount namespace), except /dev/shm, which is the host's. A
mounted ConfigMap's files follow the ConfigMap while the pod runs, each changed file replaced
whole, as the kubelet does (it swaps a symlink; a real one takes up to a minute or so).
Readiness comes from the rendered readinessProbe; Deployment status is written back as the
Deployment controller would, for the generation it ran. Securitycontexts, resources and
scheduling fields are not emulated.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from kubernetes.dynamic import DynamicClient

from omni_cli.forked import ForkedProcess
from tests.helpers import FORKED_COMMANDS, HTTP

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Pod:
    name: str
    deployment: str
    template_hash: str
    ip: str
    labels: dict[str, str]
    proc: subprocess.Popen[bytes] | ForkedProcess
    log: Path
    readiness: dict[str, Any] | None
    ports: dict[str, int]
    ready: bool = False
    spec: dict[str, Any] = field(default_factory=dict)
    config_maps: dict[Path, str] = field(default_factory=dict)
    """Local directory of each mounted ConfigMap volume -> the ConfigMap's name."""


class Kubelet:
    """Runs every Deployment of `namespace` as local processes until stopped."""

    def __init__(self, dyn: DynamicClient, namespace: str, workdir: Path) -> None:
        self.dyn = dyn
        self.namespace = namespace
        self.workdir = workdir
        self.pods: dict[str, Pod] = {}
        self.errors: list[str] = []
        self._next_ip = 10
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            self._kill(*self.pods.values())
            self.pods.clear()

    def _api(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def _read(self, kind: str, name: str) -> dict[str, Any]:
        return dict(self._api("v1", kind).get(name=name, namespace=self.namespace).to_dict())

    # --- what tests use ---

    def service_url(self, url: str) -> str:
        """kube-proxy: `http://<service>.<ns>.svc:<port>/...` -> a ready pod behind that Service."""
        parts = urlsplit(url)
        service = parts.hostname.split(".")[0]  # type: ignore[union-attr]
        svc = self._read("Service", service)["spec"]
        selector = svc["selector"]
        port = next(p for p in svc["ports"] if p["port"] == parts.port)
        with self._lock:
            for pod in self.pods.values():
                if pod.ready and all(pod.labels.get(k) == v for k, v in selector.items()):
                    target = port["targetPort"]
                    target = pod.ports[target] if isinstance(target, str) else target
                    return urlunsplit(parts._replace(netloc=f"{pod.ip}:{target}"))
        raise LookupError(f"no ready endpoint for Service {service}")

    def pod_urls(self, deployment: str) -> list[str]:
        """`http://<pod IP>:<http port>` of each ready pod of a Deployment (its /metrics)."""
        with self._lock:
            pods = [p for p in self.pods.values() if p.deployment == deployment and p.ready]
            return [f"http://{p.ip}:{p.ports['http']}" for p in pods]

    def alive(self) -> list[int]:
        with self._lock:
            return [p.proc.pid for p in self.pods.values() if p.proc.poll() is None]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log.read_text()[-2000:]}" for p in self.pods.values())

    # --- the loop ---

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._sync()
            except Exception as exc:  # the API server may be going away at teardown
                self.errors.append(repr(exc))

    def _sync(self) -> None:
        kind = self._api("apps/v1", "Deployment")
        deployments = kind.get(namespace=self.namespace).to_dict()["items"]
        names = {d["metadata"]["name"] for d in deployments}
        with self._lock:
            gone = [p for p in self.pods.values() if p.deployment not in names]
            self._kill(*gone)
            for pod in gone:
                del self.pods[pod.name]
        for d in deployments:
            self._sync_deployment(kind, d)

    def _sync_deployment(self, kind: Any, d: dict[str, Any]) -> None:
        name = d["metadata"]["name"]
        want = d["spec"].get("replicas", 1)
        template = d["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        with self._lock:
            mine = [p for p in self.pods.values() if p.deployment == name]
            current = [p for p in mine if p.template_hash == digest]
            gone = [p for p in mine if p.template_hash != digest] + current[want:]  # Recreate, scale down
            self._kill(*gone)
            for pod in gone:
                del self.pods[pod.name]
            mine = current[:want]
            for _ in range(want - len(mine)):
                pod = self._start(name, digest, template)
                self.pods[pod.name] = pod
            mine = [p for p in self.pods.values() if p.deployment == name]
            for pod in mine:
                for local, config_map in pod.config_maps.items():
                    self._write_config_map(config_map, local)
                self._check(pod)
            for pod in [p for p in mine if p.proc.poll() is not None]:  # replaced on the next pass
                self.errors.append(f"{pod.name} exited {pod.proc.returncode}:\n{pod.log.read_text()[-2000:]}")
                del self.pods[pod.name]
                mine.remove(pod)
            ready = sum(p.ready for p in mine)
        status = {
            "observedGeneration": d["metadata"].get("generation", 1),
            "replicas": len(mine),
            "updatedReplicas": len(mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if {k: (d.get("status") or {}).get(k) for k in status} != status:
            kind.status.patch(
                body={"status": status},
                name=name,
                namespace=self.namespace,
                content_type="application/merge-patch+json",
            )

    # --- pods ---

    def _start(self, deployment: str, digest: str, template: dict[str, Any]) -> Pod:
        self._next_ip += 1
        ip = f"127.0.0.{self._next_ip}"
        name = f"{deployment}-{digest[:6]}-{self._next_ip}"
        poddir = self.workdir / name
        poddir.mkdir(parents=True)
        spec = template["spec"]
        (container,) = spec["containers"]
        mounts, config_maps = self._volumes(spec, container, poddir)
        env = self._env(container, name, ip)
        argv = container.get("command", []) + container.get("args", [])
        args = [self._expand(a, env, ip, mounts) for a in argv]
        log = poddir / "container.log"
        venv_bin = str(Path(sys.executable).parent)
        proc_env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(poddir), "PYTHONUNBUFFERED": "1", **env}
        log.touch()
        proc: subprocess.Popen[bytes] | ForkedProcess
        if args[0] == "omni" and args[1] in FORKED_COMMANDS:
            proc = ForkedProcess(args[1:], poddir, proc_env, log)
        else:
            proc = subprocess.Popen(
                args,
                cwd=poddir,
                env=proc_env,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        return Pod(
            name=name,
            deployment=deployment,
            template_hash=digest,
            ip=ip,
            labels=dict(template["metadata"].get("labels") or {}),
            proc=proc,
            log=log,
            readiness=container.get("readinessProbe"),
            ports=ports,
            spec=spec,
            config_maps=config_maps,
        )

    def _volumes(
        self, spec: dict[str, Any], container: dict[str, Any], poddir: Path
    ) -> tuple[dict[str, str], dict[Path, str]]:
        """Materialize the pod's volumes; return mountPath -> local directory, and each ConfigMap
        volume's local directory -> its ConfigMap."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts: dict[str, str] = {}
        config_maps: dict[Path, str] = {}
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if m["mountPath"] == "/dev/shm":
                mounts[m["mountPath"]] = "/dev/shm"
                continue
            local = poddir / "volumes" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol:
                config_maps[local] = vol["configMap"]["name"]
                self._write_config_map(vol["configMap"]["name"], local)
            mounts[m["mountPath"]] = str(local)
        return mounts, config_maps

    def _write_config_map(self, name: str, local: Path) -> None:
        for key, value in (self._read("ConfigMap", name).get("data") or {}).items():
            f = local / key
            if not f.exists() or f.read_text() != value:
                staged = local / f"..{key}.staged"
                staged.write_text(value)
                os.replace(staged, f)

    def _env(self, container: dict[str, Any], pod: str, ip: str) -> dict[str, str]:
        env: dict[str, str] = {}
        fields = {"metadata.name": pod, "metadata.namespace": self.namespace, "status.podIP": ip}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
            elif ref := e.get("valueFrom", {}).get("fieldRef"):
                env[e["name"]] = fields[ref["fieldPath"]]
            elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
                data = self._read("Secret", ref["name"])
                if "stringData" in data and ref["key"] in data["stringData"]:
                    env[e["name"]] = data["stringData"][ref["key"]]
                else:
                    env[e["name"]] = base64.b64decode(data["data"][ref["key"]]).decode()
            else:
                raise NotImplementedError(f"env source of {e['name']}")
        return env

    @staticmethod
    def _expand(arg: str, env: dict[str, str], ip: str, mounts: dict[str, str]) -> str:
        arg = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)
        if arg == "0.0.0.0":
            return ip
        for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if arg == path or arg.startswith(path + "/"):
                return local + arg[len(path) :]
        return arg

    def _check(self, pod: Pod) -> None:
        if pod.proc.poll() is not None:
            pod.ready = False
            return
        probe = (pod.readiness or {}).get("httpGet")
        if probe is None:
            pod.ready = True
            return
        port = probe["port"]
        port = pod.ports[port] if isinstance(port, str) else port
        try:
            pod.ready = HTTP.get(f"http://{pod.ip}:{port}{probe['path']}", timeout=1).status_code < 400
        except httpx.HTTPError:
            pod.ready = False

    def _kill(self, *pods: Pod) -> None:
        """Stop pods as the kubelet does: all at once, each SIGTERM, then SIGKILL after its grace."""
        for pod in pods:
            if pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGTERM)
        start = time.monotonic()
        for pod in pods:
            grace = pod.spec.get("terminationGracePeriodSeconds", 30)
            try:
                pod.proc.wait(max(0.0, start + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.errors.append(f"{pod.name} still running {grace}s after SIGTERM: killed")
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait(5)
            shutil.rmtree(pod.log.parent / "volumes", ignore_errors=True)
