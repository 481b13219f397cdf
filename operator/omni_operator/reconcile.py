"""Reconcile one OmniPipeline: read it, render it, apply, prune, report. Level-based.

Every trigger (the CR changed, a child changed or vanished, the drift timer) calls the same
`reconcile(namespace, name)`, which reads the latest object itself; so a late or repeated
trigger cannot apply a stale spec, and running it twice does nothing the first did not.
One lock per pipeline keeps two triggers from pruning each other's work.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Final

from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError

from omni_pipeline.spec import PipelineFile, SpecError, parse_pipeline

from .cluster import DEPLOYMENTS, PIPELINE_API, Cluster, owner_reference
from .crd import KIND
from .metrics import OperatorMetrics
from .render import render, unservable
from .status import apply_failed, invalid_spec, noted, pipeline_status

log = logging.getLogger("omni.operator")


class ApplyError(RuntimeError):
    """The API server refused a child; the pipeline's Degraded condition says which and why."""


class Reconciler:
    """Drives every OmniPipeline it is asked about towards its spec."""

    def __init__(self, cluster: Cluster, image: str) -> None:
        self.cluster = cluster
        self.image = image
        self._locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        self._locks_lock = threading.Lock()
        self._conditions: dict[tuple[str, str], list[dict[str, Any]]] = {}
        """Each pipeline's conditions as last written (the metrics count them)."""
        self.metrics = OperatorMetrics(lambda: list(self._conditions.values()))

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks[(namespace, name)]

    def _forget(self, namespace: str, name: str) -> None:
        """Drop the lock of a pipeline found gone (a later trigger makes a new one)."""
        with self._locks_lock:
            self._locks.pop((namespace, name), None)
        self._conditions.pop((namespace, name), None)

    def reconcile(self, namespace: str, name: str) -> None:
        self._locked(namespace, name, self._reconcile)

    def refresh_status(self, namespace: str, name: str) -> None:
        """A child changed: report it. A spec not yet rendered is reconciled instead."""
        self._locked(namespace, name, self._refresh)

    def _locked(self, namespace: str, name: str, act: Callable[[dict[str, Any]], None]) -> None:
        """Run `act` on the latest object, under the pipeline's lock; nothing if it is gone."""
        with self._lock(namespace, name):
            body = self.cluster.pipeline(namespace, name)
            if body is not None and not body["metadata"].get("deletionTimestamp"):
                act(body)
                return
        self._forget(namespace, name)  # gone or going: the garbage collector removes the children

    def _refresh(self, body: dict[str, Any]) -> None:
        status = body.get("status") or {}
        if status.get("observedGeneration") != body["metadata"].get("generation", 1):
            self._reconcile(body)
            return
        try:
            pipeline = self._parse(body)
        except SpecError:
            return  # InvalidSpec is already reported for this generation
        self._report(body, pipeline)

    def _parse(self, body: dict[str, Any]) -> PipelineFile:
        """The spec as a pipeline pods can serve, or SpecError naming the stage and field."""
        meta = body["metadata"]
        doc = {"apiVersion": PIPELINE_API, "kind": KIND, "metadata": {"name": meta["name"]}}
        source = f"OmniPipeline {meta['namespace']}/{meta['name']}"
        pipeline = parse_pipeline({**doc, "spec": body.get("spec")}, source)
        if problems := unservable(pipeline):
            raise SpecError(f"{source}: cannot run on Kubernetes:\n  " + "\n  ".join(problems))
        return pipeline

    def _reconcile(self, body: dict[str, Any]) -> None:
        t = time.monotonic()
        result = "error"
        try:
            result = self._apply_spec(body)
        except ApplyError:
            result = "apply_failed"
            raise
        finally:
            self.metrics.reconciles.labels(result=result).inc()
            self.metrics.reconcile_seconds.observe(time.monotonic() - t)

    def _apply_spec(self, body: dict[str, Any]) -> str:
        """Render, apply, prune, report; returns how it went (ApplyError: a child was refused)."""
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        previous = body.get("status") or {}
        try:
            pipeline = self._parse(body)
        except SpecError as exc:
            log.warning("%s", exc)
            self._write_status(namespace, name, noted(generation, invalid_spec(str(exc)), previous))
            return "invalid_spec"
        desired = render(pipeline, namespace, self.image)
        owner = owner_reference(body)
        floors = autoscaler_floors(desired)
        for obj in desired:
            obj["metadata"]["ownerReferences"] = [owner]
            try:
                if obj["kind"] == DEPLOYMENTS.kind and obj["metadata"]["name"] in floors:
                    self._apply_autoscaled(obj, floors[obj["metadata"]["name"]])
                else:
                    self.cluster.apply(obj)
            except (ApiException, DynamicApiError) as exc:
                what = f"{obj['kind']} {obj['metadata']['name']}: {_reason(exc)}"
                self._write_status(namespace, name, noted(generation, apply_failed(what), previous))
                raise ApplyError(what) from exc
        wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
        kept = []
        for child in self.cluster.owned(namespace, name, meta["uid"]):
            if (child["kind"], child["metadata"]["name"]) in wanted:
                kept.append(child)
            else:
                log.info("%s/%s: pruning %s %s", namespace, name, child["kind"], child["metadata"]["name"])
                self.cluster.delete(child)
        self._report(body, pipeline, kept)
        return "applied"

    def _apply_autoscaled(self, deployment: dict[str, Any], floor: int) -> None:
        """Apply a Deployment an autoscaler scales, handing its `replicas` over without a dip.

        It is applied without `replicas`. Were the operator the field's only owner (the stage
        had a fixed count until now), that would release it and the API server would reset it
        to 1 until the autoscaler next acts. So a second manager holds the field first, at its
        live value (a new Deployment is made at the autoscaler's floor), and keeps it until the
        autoscaler's own writes take it: the count goes from the operator's to the
        autoscaler's with no value in between."""
        live = self.cluster.get(deployment)
        if live is None:
            self.cluster.apply({**deployment, "spec": {**deployment["spec"], "replicas": floor}})
            self.cluster.hold_replicas(deployment, floor)
            return
        self.cluster.hold_replicas(deployment, int(live["spec"].get("replicas", floor)))
        self.cluster.apply(deployment)

    def _report(
        self, body: dict[str, Any], pipeline: PipelineFile, children: list[dict[str, Any]] | None = None
    ) -> None:
        """Write the status from the children (listed here unless the caller just listed them)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if children is None:
            children = self.cluster.owned(namespace, name, meta["uid"], kinds=[DEPLOYMENTS])
        deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == DEPLOYMENTS.kind}
        previous = (body.get("status") or {}).get("conditions") or []
        status = pipeline_status(pipeline, namespace, meta.get("generation", 1), deployments, previous)
        self._write_status(namespace, name, status.model_dump(by_alias=True, mode="json"))

    def _write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._conditions[(namespace, name)] = status.get("conditions") or []
        self.cluster.patch_status(namespace, name, status)


_FLOOR: Final = {"HorizontalPodAutoscaler": "minReplicas", "ScaledObject": "minReplicaCount"}
"""Where each kind of autoscaler says the least replicas it keeps."""


def autoscaler_floors(objects: list[dict[str, Any]]) -> dict[str, int]:
    """Deployment name -> the least replicas its autoscaler keeps, for each one scaled."""
    return {
        o["spec"]["scaleTargetRef"]["name"]: int(o["spec"][_FLOOR[o["kind"]]])
        for o in objects
        if o["kind"] in _FLOOR
    }


def _reason(exc: ApiException | DynamicApiError) -> str:
    """The API server's own message (kubectl shows the same), not the client's HTTP dump."""
    body = getattr(exc, "body", None)
    try:
        return str(json.loads(body)["message"]) if body else str(exc)
    except (ValueError, KeyError, TypeError):
        return str(exc).splitlines()[0]
