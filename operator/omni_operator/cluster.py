"""The operator's only door to the API server: apply, list what a pipeline owns, delete, status.

Children are written with server-side apply under one field manager, so a re-apply is a no-op
when nothing changed and undoes drift in the fields the operator owns while leaving fields that
others own (an HPA's `replicas`) alone. A second manager holds an autoscaled Deployment's
`replicas` while it passes to the autoscaler (`hold_replicas`). Children are found by label and
kept only if an owner reference names the pipeline's uid, so the operator never touches what it
did not create.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

from kubernetes.client import ApiClient
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError, ResourceNotFoundError

from .crd import GROUP, KIND, VERSION
from .render import INSTANCE_LABEL, MANAGED_BY, MANAGED_BY_LABEL

FIELD_MANAGER: Final = "omni-operator"
REPLICAS_MANAGER: Final = "omni-operator-replicas"
"""Holds an autoscaled Deployment's `replicas` until the autoscaler's own writes take it."""
PIPELINE_API: Final = f"{GROUP}/{VERSION}"


class ChildKind(NamedTuple):
    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


DEPLOYMENTS: Final = ChildKind("apps/v1", "Deployment", "deployments")
SCALED_OBJECTS: Final = ChildKind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects")
CHILD_KINDS: Final = (
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    DEPLOYMENTS,
    ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    SCALED_OBJECTS,
)
"""Every kind `render` produces; the chart's RBAC grants exactly these."""
WATCHED_KINDS: Final = tuple(k for k in CHILD_KINDS if k is not SCALED_OBJECTS)
"""The children whose changes the operator watches. Not KEDA's: a cluster may not have it (the
periodic re-apply undoes drift in a ScaledObject)."""


def owner_reference(pipeline: dict[str, Any]) -> dict[str, Any]:
    meta = pipeline["metadata"]
    return {
        "apiVersion": PIPELINE_API,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj.get("metadata", {}).get("ownerReferences") or [])


class Cluster:
    """Typed-enough access to the kinds the operator manages, through the dynamic client."""

    def __init__(self, api: ApiClient) -> None:
        self._dyn = DynamicClient(api)

    def _kind(self, api_version: str, kind: str) -> Any:
        return self._dyn.resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: dict[str, Any], manager: str = FIELD_MANAGER, force: bool = True) -> None:
        meta = obj["metadata"]
        self._kind(obj["apiVersion"], obj["kind"]).server_side_apply(
            body=obj,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=manager,
            force_conflicts=force,
        )

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The live object named like `obj`, or None."""
        meta = obj["metadata"]
        try:
            kind = self._kind(obj["apiVersion"], obj["kind"])
            return kind.get(name=meta["name"], namespace=meta["namespace"]).to_dict()
        except NotFoundError:
            return None

    def hold_replicas(self, deployment: dict[str, Any], replicas: int) -> bool:
        """Own the Deployment's `replicas`, at `replicas`, under REPLICAS_MANAGER. Never forced:
        a conflict means another manager (the autoscaler) set another value since it was read,
        and so owns it: then nothing is done (False)."""
        meta = deployment["metadata"]
        body = {
            "apiVersion": deployment["apiVersion"],
            "kind": deployment["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": replicas},
        }
        try:
            self.apply(body, REPLICAS_MANAGER, force=False)
        except ConflictError:
            return False
        return True

    def owned(
        self, namespace: str, pipeline: str, uid: str, kinds: Iterable[ChildKind] = CHILD_KINDS
    ) -> list[dict[str, Any]]:
        """Every child of the pipeline with this uid, of the given kinds (default: all managed)."""
        selector = f"{INSTANCE_LABEL}={pipeline},{MANAGED_BY_LABEL}={MANAGED_BY}"
        out = []
        for api_version, kind, _ in kinds:
            try:
                resource = self._kind(api_version, kind)
            except ResourceNotFoundError:  # not served here (KEDA not installed): none exist
                continue
            listing = resource.get(namespace=namespace, label_selector=selector)
            for item in listing.to_dict().get("items") or []:
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                if owned_by(item, uid):
                    out.append(item)
        return out

    def delete(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        with contextlib.suppress(NotFoundError):  # already gone: what prune wanted
            self._kind(obj["apiVersion"], obj["kind"]).delete(
                name=meta["name"], namespace=meta["namespace"], body={"propagationPolicy": "Background"}
            )

    def pipeline(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._kind(PIPELINE_API, KIND).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def pipelines(self, namespaces: list[str]) -> list[tuple[str, str]]:
        """(namespace, name) of every OmniPipeline in `namespaces` (all of them if empty)."""
        kind = self._kind(PIPELINE_API, KIND)
        listings = [kind.get(namespace=ns) for ns in namespaces] if namespaces else [kind.get()]
        items = [i for listing in listings for i in listing.to_dict().get("items") or []]
        return [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(NotFoundError):  # deleted meanwhile: nothing left to report on
            self._kind(PIPELINE_API, KIND).status.patch(
                body={"status": status},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
