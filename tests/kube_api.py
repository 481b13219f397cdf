"""A Kubernetes API server for tests: kmock's emulator plus the few server behaviours the operator
relies on, run in its own thread so that tests, kopf and the kubelet harness all talk to it over
HTTP like they would to a cluster.

Fake on purpose (no cluster can run here): kmock stores objects and serves list/watch/get/create/
patch/delete. What a real API server and kube-controller-manager add, and kmock leaves to its
users, is added here and nothing more: server-set metadata (uid, creationTimestamp,
resourceVersion, `generation` bumped when the spec changes), the status subresource (status
writes touch only status; main writes never touch it), server-side apply with field ownership
across managers (tests/kube_fields.py: an apply that drops a field it alone owned removes it,
conflicts are 409s unless forced) and the one default it matters for (a Deployment's
`spec.replicas`: 1), equality label selectors on lists, and the garbage collector (deleting an
owner deletes what it owns; what is created for an owner already gone is deleted at once).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import hashlib
import itertools
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import kubernetes
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from tests import kube_fields

PIPELINE_API = "omnipipeline.dev/v1alpha1"
APPLY_PATCH = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"

RESOURCES: dict[str, kmock.ResourceInfo] = {
    "omnipipeline.dev/v1alpha1/omnipipelines": kmock.ResourceInfo(
        kind="OmniPipeline", singular="omnipipeline", namespaced=True, shortnames={"omp"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", singular="deployment", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service", singular="service", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap", singular="configmap", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/secrets": kmock.ResourceInfo(
        kind="Secret", singular="secret", namespaced=True, verbs={"get", "list", "create", "delete"},
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
        verbs={"get", "list", "watch", "create", "delete"},
    ),
    "v1/namespaces": kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list", "watch"},
    ),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True, verbs={"create"}),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(
        kind="Lease", singular="lease", namespaced=True, verbs={"get", "list", "create", "update", "patch"},
    ),
    "keda.sh/v1alpha1/scaledobjects": kmock.ResourceInfo(
        kind="ScaledObject", singular="scaledobject", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "autoscaling/v2/horizontalpodautoscalers": kmock.ResourceInfo(
        kind="HorizontalPodAutoscaler", singular="horizontalpodautoscaler", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
}  # fmt: skip


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with the server-side behaviours listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        for key, info in RESOURCES.items():
            self.resources[key] = info

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock logs every request for assertions and matches each one to its reactions by
        # scanning that log, by identity. Nothing here asserts on it, so a request leaves the log
        # once answered, and the log holds the requests in flight (the watches, mostly): kept
        # whole (or cut back to 16 past 256), it made the scan most of the operator tests' CPU.
        logged = request
        try:
            if request.resource is not None:
                try:
                    served = await self._server_side(request)
                except (kube_fields.ApplyConflict, StaleWrite) as exc:  # answers, not emulator failures
                    return _status(409, "Conflict", str(exc))
                if served is not request:
                    self._requests[self._logged_at(request)] = logged = served
                request = served
            response = await super()._handle(request)
        finally:
            del self._requests[self._logged_at(logged)]
        # The garbage collector: after a delete, and after a create, since an object created for
        # an owner already gone (an operator's apply that raced the owner's deletion) is collected
        # too: a real cluster's collector deletes any dependent whose owners are all absent.
        deleted = request.action == kmock.action.DELETE and request.name
        if request.resource is not None and (deleted or request.action == kmock.action.CREATE):
            await self._collect_garbage()
        return response

    def _logged_at(self, request: kmock.Request) -> int:
        """Where `request` itself is in kmock's log (an equal request may be there too)."""
        return next(i for i, r in enumerate(self._requests) if r is request)

    async def _server_side(self, request: kmock.Request) -> kmock.Request:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            current = self.objects[key] if request.name and key in self.objects else None
            exists = current is not None and not current.deleted
            old = copy.deepcopy(current.raw) if exists else None
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        manager = request.params.get("fieldManager") or "unnamed"
        force = request.params.get("force") == "true"
        if request.action == kmock.action.CREATE:
            body = _defaulted(kube_fields.created(self._typed(request), manager))
            return attrs.evolve(request, data=self._created(body, request.namespace))
        if request.method == kmock.method.PATCH and content_type == APPLY_PATCH and not exists:
            config = yaml.safe_load(request.text)
            body = _defaulted(kube_fields.apply(None, config, manager, force))
            body["metadata"]["name"] = config["metadata"]["name"]
            return attrs.evolve(
                request, action=kmock.action.CREATE, data=self._created(body, request.namespace)
            )
        if request.method == kmock.method.PUT and request.name and old is not None:
            request = attrs.evolve(request, action=kmock.action.UPDATE)  # a replace: kmock has no PUT
        if request.action != kmock.action.UPDATE or old is None:
            return request
        if request.method == kmock.method.PUT:
            given = (request.data.get("metadata") or {}).get("resourceVersion")
            if given and given != old["metadata"].get("resourceVersion"):
                raise StaleWrite(f"the object has been modified (resourceVersion {given} is stale)")
            new = _defaulted(kube_fields.update(old, {**request.data, "status": old.get("status")}, manager))
            new["metadata"] = {**new.get("metadata", {}), **_server_meta(old)}
            if new["status"] is None:
                del new["status"]
        elif content_type == APPLY_PATCH:
            new = _defaulted(kube_fields.apply(old, yaml.safe_load(request.text), manager, force))
            new["metadata"] = {**new.get("metadata", {}), **_server_meta(old)}
        else:
            if content_type == JSON_PATCH:
                new = jsonpatch.apply_patch(old, request.data)
            else:  # merge patch; strategic merge is treated as one (no list merging by key)
                merged = kmock.Object(old)
                merged.patch(request.data)
                new = copy.deepcopy(merged.raw)
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
            else:
                new = _defaulted(kube_fields.update(old, {**new, "status": old.get("status")}, manager))
            new["metadata"] = {**new.get("metadata", {}), **_server_meta(old)}
            if new["status"] is None:
                del new["status"]
        meta = new["metadata"]
        meta["resourceVersion"] = str(next(self._versions))
        if request.subresource is None and new.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        return attrs.evolve(request, data=[{"op": "replace", "path": "", "value": new}])

    def _typed(self, request: kmock.Request) -> dict[str, Any]:
        """The body with its apiVersion and kind, as the API server stores every object (typed
        clients may leave them out)."""
        res = request.resource
        api_version = f"{res.group}/{res.version}".lstrip("/")
        return {"apiVersion": api_version, "kind": self.resources[res].kind, **request.data}

    def _created(self, body: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            resourceVersion=str(next(self._versions)),
            generation=1,
        )
        return body

    async def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone, until none is left (cascading)."""
        async with self._lock:
            while True:
                live = [(k, o) for k, o in self.objects.items() if not o.deleted]
                uids = {o.raw["metadata"].get("uid") for _, o in live}
                orphans = [
                    (k, o)
                    for k, o in live
                    if (refs := o.raw["metadata"].get("ownerReferences"))
                    and not any(r.get("uid") in uids for r in refs)
                ]
                if not orphans:
                    return
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

    async def _serve_list(self, request: kmock.Request) -> Any:
        listing = await super()._serve_list(request)
        res = request.resource
        listing["kind"] = f"{self.resources[res].kind}List"
        listing["apiVersion"] = f"{res.group}/{res.version}".lstrip("/")
        selector = request.params.get("labelSelector")
        if selector:
            listing["items"] = [o for o in listing["items"] if _selects(selector, o)]
        return listing


class StaleWrite(Exception):
    """A replace based on an old resourceVersion (optimistic concurrency: leader election's)."""


def _defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    """The API server's defaulting, for the field it matters for here: a Deployment with no
    `replicas` (none asked, or the last manager that set it let go of it) runs 1."""
    if obj.get("kind") == "Deployment":
        obj.setdefault("spec", {}).setdefault("replicas", 1)
    return obj


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return aiohttp.web.json_response(
        {**body, "message": message, "reason": reason, "code": code}, status=code
    )


def _server_meta(old: dict[str, Any]) -> dict[str, Any]:
    keep = ("uid", "creationTimestamp", "resourceVersion", "generation", "deletionTimestamp")
    return {k: old["metadata"][k] for k in keep if k in old["metadata"]}


def _selects(selector: str, obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.strip() and term.strip() not in labels:
            return False
    return True


def discovery_cache(url: str) -> Path:
    """Where the kubernetes client's dynamic discovery caches what the server at `url` serves
    (kubernetes.dynamic.discovery: the temporary directory, a file named by the URL's hash).
    Every DynamicClient of the server writes it, the test's and the operator's alike; each
    server's port is new, so the file would be left behind by every test that starts one."""
    name = hashlib.md5(url.encode(), usedforsecurity=False).hexdigest()
    return Path(tempfile.gettempdir()) / f"osrcp-{name}.json"


class ApiServerThread:
    """Runs an `ApiServer` on 127.0.0.1 in a thread with its own event loop; writes a kubeconfig.
    On exit it also removes what its clients cached of it (`discovery_cache`)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._server: ApiServer | None = None
        self._thread = threading.Thread(target=self._run, name="kube-api", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> ApiServerThread:
        self._thread.start()
        if not self._ready.wait(30) or self.error is not None:
            raise RuntimeError(f"the test API server did not start: {self.error!r}")
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
            "current-context": "kmock",
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self.url:
            discovery_cache(self.url).unlink(missing_ok=True)

    def versions(self, resource: str, namespace: str, name: str) -> list[dict[str, Any]]:
        """Every version an object has had, oldest first (`resource`: "apps/v1/deployments"):
        what a test asserts a transition never passed through."""
        server = self._server
        assert server is not None

        async def read() -> list[dict[str, Any]]:
            async with server._lock:
                history = server.objects[resource, namespace, name].history
                return [copy.deepcopy(dict(v)) for v in history if v is not None]

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self.error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with ApiServer() as handler, kmock.Server(handler) as server:
            self._server = handler
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()


def pipeline_body(name: str) -> dict[str, Any]:
    """An OmniPipeline resource: tests/data/synthetic-distributed.yaml, named `name`."""
    doc = yaml.safe_load((Path(__file__).parent / "data" / "synthetic-distributed.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["nats"] = {"url": "nats://nats.omni.svc:4222"}
    return doc


class Kube:
    """The test's kubectl: a dynamic client on the emulator (and the emulator, to read history)."""

    def __init__(self, kubeconfig: Path, server: ApiServerThread | None = None) -> None:
        self.dyn = DynamicClient(kubernetes.config.new_client_from_config(str(kubeconfig)))
        self._server = server

    @property
    def server(self) -> ApiServerThread:
        assert self._server is not None, "this Kube was made without its server"
        return self._server

    def kind(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def get(self, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return self.kind(api_version, kind).get(name=name, namespace=ns).to_dict()
        except NotFoundError:
            return None

    def names(self, api_version: str, kind: str, ns: str) -> set[str]:
        items = self.kind(api_version, kind).get(namespace=ns).to_dict()["items"]
        return {i["metadata"]["name"] for i in items}

    def pipeline(self, ns: str, name: str) -> dict[str, Any]:
        body = self.get(PIPELINE_API, "OmniPipeline", ns, name)
        assert body is not None
        return body

    def condition(self, ns: str, name: str, kind: str) -> dict[str, Any] | None:
        for c in (self.pipeline(ns, name).get("status") or {}).get("conditions") or []:
            if c["type"] == kind:
                return c
        return None

    def create(self, body: dict[str, Any], ns: str) -> dict[str, Any]:
        return self.kind(PIPELINE_API, "OmniPipeline").create(body=body, namespace=ns).to_dict()

    def patch_spec(self, ns: str, name: str, spec: dict[str, Any]) -> None:
        self.kind(PIPELINE_API, "OmniPipeline").patch(
            body=[{"op": "replace", "path": "/spec", "value": spec}],
            name=name,
            namespace=ns,
            content_type="application/json-patch+json",
        )

    def roll_out(self, ns: str, name: str, ready: int | None = None) -> None:
        """Play the Deployment controller: report `ready` (default: all) replicas updated and
        available for the Deployment's current generation."""
        d = self.get("apps/v1", "Deployment", ns, name)
        assert d is not None, name
        want = d["spec"].get("replicas", 1)
        n = want if ready is None else ready
        status = {
            "observedGeneration": d["metadata"]["generation"],
            "replicas": want,
            "updatedReplicas": want,
            "readyReplicas": n,
            "availableReplicas": n,
        }
        self.kind("apps/v1", "Deployment").status.patch(
            body={"status": status}, name=name, namespace=ns, content_type="application/merge-patch+json"
        )
