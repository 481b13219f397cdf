"""The environment variables omni processes read, named once: the operator writes them into the
pods it renders and the processes read them, so both sides import them from here (and the
operator imports no NATS client or connector to learn a name)."""

from __future__ import annotations

from typing import Final

NATS_URL_ENV: Final = "OMNI_NATS_URL"
"""The NATS URL; a token or user and password go in it (nats://TOKEN@host, nats://user:pw@host)."""
NATS_CREDS_ENV: Final = "OMNI_NATS_CREDS"
"""A NATS credentials file (JWT and NKey seed), for servers with decentralised auth."""
NATS_TLS_CA_ENV: Final = "OMNI_NATS_TLS_CA"
NATS_TLS_CERT_ENV: Final = "OMNI_NATS_TLS_CERT"
NATS_TLS_KEY_ENV: Final = "OMNI_NATS_TLS_KEY"
"""PEM files: the CA that signed the server's certificate; our client certificate and key
(mutual TLS). Any of them turns TLS on."""

MOONCAKE_MASTER_ENV: Final = "OMNI_MOONCAKE_MASTER"
MOONCAKE_METADATA_ENV: Final = "OMNI_MOONCAKE_METADATA"
"""Mooncake's master and metadata server, over the pipeline file's (a pod learns them here)."""
