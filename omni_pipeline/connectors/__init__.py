"""Data-plane connectors, built by name from the pipeline's `spec.connectors`."""

from __future__ import annotations

from omni_pipeline.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    InlineConnector,
    OmniConnector,
    check_request_id,
)
from omni_pipeline.connectors.shm import ShmConnector
from omni_pipeline.spec import ConnectorKind, PipelineSpec

__all__ = [
    "ConnectorError",
    "ConnectorHandle",
    "InlineConnector",
    "OmniConnector",
    "ShmConnector",
    "build_connectors",
    "check_request_id",
]


def build_connectors(spec: PipelineSpec) -> dict[str, OmniConnector]:
    """One connector instance per name in `spec.connectors`."""
    out: dict[str, OmniConnector] = {}
    for name, cspec in spec.connectors.items():
        if cspec.kind is ConnectorKind.INLINE:
            out[name] = InlineConnector(name, cspec)
        elif cspec.kind is ConnectorKind.SHM:
            out[name] = ShmConnector(name, cspec)
        else:
            raise ConnectorError(f"connector '{name}': kind '{cspec.kind}' is not available yet")
    return out
