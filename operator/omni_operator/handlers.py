"""The kopf wiring: which events reach `Reconciler`, and how kopf itself is configured.

Triggers: the OmniPipeline is created, changed or found at start-up; a child Deployment changes
(status to report) or any child is deleted (drift to undo); and a resync every
`resync_seconds` for drift nobody announced. No handler needs a finalizer (no timers or
daemons on the CR, deletion left to the garbage collector), so an uninstalled operator can
never leave a pipeline, or its namespace, stuck in deletion.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

import kopf
import kubernetes.config
from kubernetes.client import ApiClient, Configuration
from prometheus_client import start_http_server

from .cluster import DEPLOYMENTS, WATCHED_KINDS, Cluster
from .crd import GROUP, KIND, PLURAL, VERSION
from .leader import wait_to_lead
from .reconcile import ApplyError, Reconciler
from .render import DEFAULT_IMAGE, MANAGED_BY, MANAGED_BY_LABEL

IMAGE_ENV: Final = "OMNI_OPERATOR_IMAGE"
RESYNC_ENV: Final = "OMNI_OPERATOR_RESYNC_SECONDS"
NAMESPACES_ENV: Final = "OMNI_OPERATOR_NAMESPACES"
METRICS_PORT_ENV: Final = "OMNI_OPERATOR_METRICS_PORT"
APPLY_RETRY_S: Final = 30.0
LEASE_NAME: Final = "omni-operator"

log = logging.getLogger("omni.operator")


@dataclass(frozen=True)
class OperatorConfig:
    image: str = DEFAULT_IMAGE
    resync_seconds: float = 60.0
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    metrics_port: int = 0
    """Where the operator's own /metrics is served (0: not served)."""

    @classmethod
    def from_env(cls) -> OperatorConfig:
        spaces = os.environ.get(NAMESPACES_ENV, "")
        return cls(
            image=os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE,
            resync_seconds=float(os.environ.get(RESYNC_ENV) or 60.0),
            namespaces=[n.strip() for n in spaces.split(",") if n.strip()],
            metrics_port=int(os.environ.get(METRICS_PORT_ENV) or 0),
        )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Kopf's bookkeeping in our own annotations; status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # Kubernetes Events for problems only
    settings.scanning.disabled = True  # no CRD watching (less RBAC); the chart installs the CRD first
    memo.setdefault("config", OperatorConfig.from_env())
    memo.resync = asyncio.create_task(_resync(memo), name="omni-resync")


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    if (task := memo.get("resync")) is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if (server := memo.get("metrics_server")) is not None:
        server.shutdown()
        server.server_close()


def load_configuration() -> Configuration:
    """The service account in a pod, else $KUBECONFIG (read now, not at import)."""
    cfg = Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG")
        try:
            kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
        except (kubernetes.config.ConfigException, OSError) as exc:
            where = f"KUBECONFIG={path}" if path else "~/.kube/config (KUBECONFIG unset)"
            msg = f"not in a pod with a service account, and no usable {where}: {exc}"
            raise kopf.LoginError(msg) from None
    return cfg


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """The service account in a pod, else $KUBECONFIG (read now, not at import): one
    configuration for kopf's watches and for our client, so both act as the same identity."""
    cfg = load_configuration()
    cluster = Cluster(ApiClient(cfg))
    if "reconciler" in memo:  # a re-login (expired token): same reconciler, fresh credentials
        memo.reconciler.cluster = cluster
    else:
        config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
        memo.reconciler = Reconciler(cluster, config.image)
        if config.metrics_port:
            registry = memo.reconciler.metrics.registry
            memo.metrics_server, _ = start_http_server(config.metrics_port, registry=registry)
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.resume(GROUP, VERSION, PLURAL, id="resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="create")
@kopf.on.update(GROUP, VERSION, PLURAL, id="update")
def pipeline_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    try:
        memo.reconciler.reconcile(namespace, name)
    except ApplyError as exc:
        raise kopf.TemporaryError(str(exc), delay=APPLY_RETRY_S) from exc


def child_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child Deployment's status moves the pipeline's; a deleted child is put back."""
    refs = body.metadata.get("ownerReferences") or []
    owner = next((r for r in refs if r.get("kind") == KIND and r.get("controller")), None)
    if owner is None or "reconciler" not in memo:
        return
    namespace = body.metadata.namespace
    if type == "DELETED":
        memo.reconciler.reconcile(namespace, owner["name"])
    elif body.get("kind") == DEPLOYMENTS.kind:
        memo.reconciler.refresh_status(namespace, owner["name"])


for _child in WATCHED_KINDS:
    kopf.on.event(
        _child.group, _child.version, _child.plural, labels={MANAGED_BY_LABEL: MANAGED_BY}, id=_child.plural
    )(child_changed)


async def _resync(memo: kopf.Memo) -> None:
    """Re-apply every pipeline now and then: undoes edits to children that raised no event."""
    config: OperatorConfig = memo.config
    while True:
        await asyncio.sleep(config.resync_seconds)
        reconciler: Reconciler | None = memo.get("reconciler")
        if reconciler is None:
            continue
        try:
            keys = await asyncio.to_thread(reconciler.cluster.pipelines, config.namespaces)
        except Exception as exc:
            log.warning("resync: cannot list OmniPipelines: %s", exc)
            continue
        for namespace, name in keys:
            try:
                await asyncio.to_thread(reconciler.reconcile, namespace, name)
            except Exception as exc:
                log.warning("resync of %s/%s failed: %s", namespace, name, exc)


def run_operator(
    image: str | None,
    namespaces: list[str],
    resync_seconds: float | None,
    liveness: str,
    metrics_port: int | None = None,
    lease: tuple[str, int] | None = None,
) -> int:
    """`omni operator`: kopf in this process's main thread, stopping on SIGTERM/SIGINT. With
    `lease` (namespace, seconds), only once it leads (omni_operator.leader)."""
    env = OperatorConfig.from_env()
    config = OperatorConfig(
        image=image or env.image,
        resync_seconds=resync_seconds if resync_seconds is not None else env.resync_seconds,
        namespaces=namespaces or env.namespaces,
        metrics_port=metrics_port if metrics_port is not None else env.metrics_port,
    )
    if lease is not None:
        identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        namespace, seconds = lease
        if not wait_to_lead(load_configuration(), namespace, LEASE_NAME, identity, seconds, liveness):
            return 0
    kopf.run(
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(config=config),
    )
    return 0
