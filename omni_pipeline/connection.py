"""Connecting to NATS: the URL checked up front, credentials and TLS from the environment, and a
connection whose loss and return every process hears of (it ends what it holds, then frees it
again once back)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import urlparse

import nats
from nats.aio.client import Client as NatsClient

from omni_pipeline.control import ControlError
from omni_pipeline.environment import (
    NATS_CREDS_ENV,
    NATS_TLS_CA_ENV,
    NATS_TLS_CERT_ENV,
    NATS_TLS_KEY_ENV,
    NATS_URL_ENV,
)

log = logging.getLogger("omni_pipeline.control")

NATS_WAIT_LOG_EVERY_S: Final = 5.0


def resolve_nats_url(url: str | None) -> str:
    """Check a NATS URL up front so a typo fails in one line, not in a retry loop."""
    if not url:
        raise ControlError(f"no NATS URL: pass --nats, set {NATS_URL_ENV}, or set spec.nats.url")
    for part in url.split(","):
        p = urlparse(part.strip())
        if p.scheme not in ("nats", "tls", "ws", "wss") or not p.hostname:
            raise ControlError(f"malformed NATS URL {part!r}: expected nats://host:port")
        try:
            _ = p.port
        except ValueError:
            raise ControlError(f"malformed NATS URL {part!r}: bad port") from None
    return url


def nats_security() -> dict[str, Any]:
    """nats.connect options from the environment: a credentials file, TLS. Missing or unreadable
    files are a ControlError, said in one line before any connection is tried."""
    env = {
        k: os.environ.get(k, "")
        for k in (NATS_CREDS_ENV, NATS_TLS_CA_ENV, NATS_TLS_CERT_ENV, NATS_TLS_KEY_ENV)
    }
    for name, path in env.items():
        if path and not os.access(path, os.R_OK):
            raise ControlError(f"{name}={path}: no such readable file")
    opts: dict[str, Any] = {}
    if creds := env[NATS_CREDS_ENV]:
        opts["user_credentials"] = creds
    ca, cert, key = env[NATS_TLS_CA_ENV], env[NATS_TLS_CERT_ENV], env[NATS_TLS_KEY_ENV]
    if ca or cert:
        try:
            tls = ssl.create_default_context(cafile=ca or None)
            if cert:
                tls.load_cert_chain(cert, key or None)
        except (ssl.SSLError, ValueError) as exc:
            raise ControlError(f"NATS TLS files ({ca or '-'}, {cert or '-'}, {key or '-'}): {exc}") from None
        opts["tls"] = tls
    elif key:
        raise ControlError(f"{NATS_TLS_KEY_ENV} is set without {NATS_TLS_CERT_ENV}")
    return opts


async def connect_nats(
    url: str,
    name: str,
    *,
    retry_for_s: float | None = None,
    stop: asyncio.Event | None = None,
    on_disconnect: Callable[[], None] | None = None,
    on_reconnect: Callable[[], None] | None = None,
) -> NatsClient | None:
    """Connect, waiting while the server is not up yet (saying so in the log every few seconds).

    nats-py itself retries the first connection, every `reconnect_time_wait`, and once
    connected it reconnects by itself for ever: servers restart; we outlive them. With
    `retry_for_s` the first connection is given up after that long (ControlError); when `stop`
    is set first (SIGTERM during startup), the wait ends and None is returned. `on_disconnect`
    runs when an established connection drops (not when we close it), `on_reconnect` when it
    is back.
    """
    resolve_nats_url(url)
    security = nats_security()
    client: list[NatsClient] = []
    last_warning = [-NATS_WAIT_LOG_EVERY_S]

    async def disconnected() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # we are closing it ourselves
        log.warning("%s: disconnected from NATS at %s", name, url)
        if on_disconnect is not None:
            on_disconnect()

    async def reconnected() -> None:
        log.info("%s: reconnected to NATS", name)
        if on_reconnect is not None:
            on_reconnect()

    async def on_error(exc: Exception) -> None:
        now = time.monotonic()
        if not client and now - last_warning[0] >= NATS_WAIT_LOG_EVERY_S:
            last_warning[0] = now
            why = str(exc) or type(exc).__name__
            log.warning("%s: NATS at %s not reachable yet (%s); still trying", name, url, why)
        else:
            log.debug("%s: NATS error: %s", name, exc)

    async def connect() -> NatsClient:
        return await nats.connect(
            url,
            name=name,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=on_error,
            **security,
        )

    attempt = asyncio.ensure_future(connect())
    waits: set[asyncio.Future[Any]] = {attempt}
    if stop is not None:
        waits.add(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(waits, timeout=retry_for_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits - {attempt}:
            w.cancel()
    if not attempt.done():
        attempt.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attempt
        if stop is not None and stop.is_set():
            return None
        raise ControlError(f"{name}: NATS at {url} unreachable for {retry_for_s:.0f}s")
    nc = attempt.result()
    client.append(nc)
    if last_warning[0] >= 0:
        log.info("%s: connected to NATS at %s", name, url)
    return nc


async def close_nats(nc: NatsClient, timeout_s: float = 2.0) -> None:
    """Drain (deliver what is pending) if the server is there; never hang on a dead one."""
    if nc.is_closed:
        return
    try:
        async with asyncio.timeout(timeout_s):
            await nc.drain()
    except Exception:
        log.debug("NATS drain did not finish; closing")
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()
