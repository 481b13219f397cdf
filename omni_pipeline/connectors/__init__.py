"""Data-plane connectors, built by name from the pipeline's `spec.connectors`."""

from __future__ import annotations

from omni_pipeline.connectors.base import (
    RECLAIM_GRACE_S,
    ConnectorError,
    ConnectorHandle,
    InlineConnector,
    OmniConnector,
    PayloadGone,
    check_request_id,
)
from omni_pipeline.connectors.shm import ShmConnector
from omni_pipeline.settings import ConnectorKind
from omni_pipeline.spec import PipelineSpec

__all__ = [
    "RECLAIM_GRACE_S",
    "ConnectorError",
    "ConnectorHandle",
    "InlineConnector",
    "OmniConnector",
    "PayloadGone",
    "ShmConnector",
    "build_connectors",
    "check_request_id",
    "reclaim_unread",
]


def build_connectors(spec: PipelineSpec, pipeline: str) -> dict[str, OmniConnector]:
    """One connector per name in `spec.connectors`; all or nothing (a failure closes the rest)."""
    out: dict[str, OmniConnector] = {}
    try:
        for name, cspec in spec.connectors.items():
            if cspec.kind is ConnectorKind.INLINE:
                out[name] = InlineConnector(name, cspec)
            elif cspec.kind is ConnectorKind.SHM:
                out[name] = ShmConnector(name, cspec)
            else:
                from omni_pipeline.connectors.mooncake import MooncakeConfig, MooncakeConnector

                out[name] = MooncakeConnector(name, cspec, pipeline, MooncakeConfig.resolve(spec.mooncake))
    except BaseException:
        for c in out.values():
            c.close()
        raise
    return out


def reclaim_unread(connectors: list[OmniConnector], spec: PipelineSpec) -> None:
    """What these connectors wrote that nobody read in longer than any request of `spec` lives."""
    for c in connectors:
        c.reclaim_unread(spec.gateway.request_timeout_s + RECLAIM_GRACE_S)
