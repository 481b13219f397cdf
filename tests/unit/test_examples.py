"""Every example pipeline file is one a user can run as it is: it loads and validates, and the
Distributed ones render into the objects the operator would create (a Deployment per stage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_operator.render import render
from omni_pipeline.spec import load_pipeline
from tests.helpers import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_example_loads_and_distributed_ones_render(path: Path) -> None:
    pipeline = load_pipeline(path)
    stages = {s.name for s in pipeline.spec.stages}
    assert stages
    if pipeline.spec.mode.value == "Distributed":
        deployments = {o["metadata"]["name"] for o in render(pipeline) if o["kind"] == "Deployment"}
        assert {f"{pipeline.metadata.name}-{s}" for s in stages} <= deployments, deployments
