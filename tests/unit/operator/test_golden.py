"""The operator renders each example pipeline exactly as its checked-in golden manifest says
(`make golden` writes them again; review the diff)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.operator.golden_manifests import GOLDEN, examples, golden, rendered


def test_every_example_that_runs_on_kubernetes_has_its_golden_manifest() -> None:
    assert {golden(e) for e in examples()} == set(GOLDEN.glob("*.yaml")), "run `make golden`"


@pytest.mark.parametrize("example", examples(), ids=lambda p: p.stem)
def test_rendered_as_the_golden_manifest(example: Path) -> None:
    assert rendered(example) == golden(example).read_text(), (
        f"the renderers changed what {example.name} becomes; if that is meant, run `make golden` "
        "and review the diff"
    )
