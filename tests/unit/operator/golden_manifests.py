"""The golden manifests: what the operator renders for each example pipeline, checked in.

`make golden` (`python -m tests.unit.operator.golden_manifests`) writes them again; a change to
the renderers shows in review as a diff of these files. tests/unit/operator/test_golden.py
checks that the renderers still give exactly them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from omni_operator.render import render, render_yaml, unservable
from omni_pipeline.spec import load_pipeline

ROOT: Final = Path(__file__).resolve().parents[3]
GOLDEN: Final = Path(__file__).with_name("golden")
NAMESPACE: Final = "omni"
IMAGE: Final = "registry.example/omni-pipeline:golden"


def examples() -> list[Path]:
    """Every example pipeline that runs on Kubernetes."""
    return [p for p in sorted((ROOT / "examples").glob("*.yaml")) if not unservable(load_pipeline(p))]


def rendered(example: Path) -> str:
    return render_yaml(render(load_pipeline(example), namespace=NAMESPACE, image=IMAGE))


def golden(example: Path) -> Path:
    return GOLDEN / example.name


def main() -> int:
    GOLDEN.mkdir(exist_ok=True)
    for stale in set(GOLDEN.glob("*.yaml")) - {golden(e) for e in examples()}:
        stale.unlink()
    for example in examples():
        golden(example).write_text(rendered(example))
        print(golden(example).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
