"""Leader election: of the operator's replicas, one reconciles and the others stand by.

A Lease (coordination.k8s.io/v1) held through the Kubernetes client's own leader election. A
replica starts kopf only once it holds the lease, and renews it every `lease_s / 5` seconds from
a thread of its own. One that cannot renew it within `lease_s * 0.7` seconds exits at once: it
may no longer lead, and two operators must never write at the same time (controller-runtime's
rule too). A standby takes the lease once the leader has not renewed it for `lease_s` seconds:
a leader killed outright is replaced within about `lease_s + lease_s / 5` seconds. While it
waits, a standby answers its liveness probe itself (kopf, which serves it when leading, has not
started).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from kubernetes.client import ApiClient, Configuration, CoordinationV1Api
from kubernetes.leaderelection import electionconfig
from kubernetes.leaderelection.leaderelection import LeaderElection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger("omni.operator")
logging.getLogger("leaderelection").setLevel(logging.WARNING)  # it says "not yet" every retry


def wait_to_lead(
    cfg: Configuration, namespace: str, name: str, identity: str, lease_s: int, liveness: str
) -> bool:
    """Block until this process holds the lease `namespace/name` (True; it then keeps it, or
    exits), or until SIGTERM or SIGINT (False: stop, never having led). Meanwhile `liveness`
    (kopf's endpoint URL) answers 200."""
    lock = LeaseLock(name, namespace, identity)
    lock.api_instance = CoordinationV1Api(ApiClient(cfg))  # the operator's identity, not the default's
    leading = threading.Event()
    config = electionconfig.Config(
        lock,
        lease_duration=lease_s,
        renew_deadline=max(2, lease_s * 7 // 10),
        retry_period=max(1, lease_s // 5),
        onstarted_leading=leading.set,
        onstopped_leading=_stop_leading,
    )
    log.info("operator %s: waiting to lead (lease %s/%s)", identity, namespace, name)
    with _alive_at(liveness), _stopped_by_signals() as stopped:
        threading.Thread(target=LeaderElection(config).run, name="leader-election", daemon=True).start()
        while not (leading.is_set() or stopped.is_set()):
            leading.wait(1.0)  # a wait the signal handler's flag can end (a bare wait swallows it)
    if not leading.is_set():
        log.info("operator %s: stopped while waiting to lead", identity)
        return False
    log.info("operator %s: leading", identity)
    return True


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT until the block ends (kopf installs its own after)."""
    stopped = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopped.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopped
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _alive_at(url: str) -> Iterator[None]:
    """200 at `url`'s path, from a thread, until the block ends (and frees the port for kopf)."""
    where = urlparse(url)

    class Alive(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == (where.path or "/")
            self.send_response(200 if ok else 404)
            self.end_headers()
            if ok:
                self.wfile.write(b"standby\n")

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((where.hostname or "0.0.0.0", where.port or 80), Alive)
    thread = threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _stop_leading() -> None:
    log.error("operator: lost the lease; exiting so that another replica leads alone")
    logging.shutdown()
    os._exit(1)
