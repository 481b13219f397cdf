"""The import layers of DESIGN.md hold (`lint-imports`, with the contracts in pyproject.toml), and
the operator starts without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_operator_imports_no_torch() -> None:
    """torch is imported where tensors are made; the operator renders manifests and makes none."""
    probe = "import sys, omni_operator.handlers; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
