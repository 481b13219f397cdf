"""The reference every Qwen3-TTS test compares with: the `qwen-tts` package's own code, run by
scripts/qwen_tts_reference.py in .venv-qwen-tts (it pins transformers 4.57). Skips the test where
that virtualenv was not built (`make test` builds it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
QWEN_TTS_PYTHON = ROOT / ".venv-qwen-tts" / "bin" / "python"


def qwen_tts_reference(request: dict[str, Any], out: Path) -> dict[str, Any]:
    """The script's result.json for `request` (its docstring says what it holds); the waveforms
    it wrote stay in `out` (`waveform(out, name)`)."""
    if not QWEN_TTS_PYTHON.exists():
        pytest.skip(f"{QWEN_TTS_PYTHON} is missing: `make qwen-tts-venv` (or `make test`) builds it")
    out.mkdir(parents=True, exist_ok=True)
    asked = out / "request.json"
    asked.write_text(json.dumps(request))
    run = subprocess.run(
        [str(QWEN_TTS_PYTHON), str(ROOT / "scripts" / "qwen_tts_reference.py"), str(asked), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def waveform(out: Path, name: str) -> np.ndarray:
    return np.load(out / f"{name}.npy", allow_pickle=False)
