"""The `qwen-tts` package (Qwen3-TTS's reference) run by scripts/qwen_tts_reference.py in its own
virtualenv, .venv-qwen-tts (it pins transformers 4.57; `make qwen-tts-venv` builds it): for the
parity tests and `omni bench tts`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[1]
QWEN_TTS_PYTHON: Final = ROOT / ".venv-qwen-tts" / "bin" / "python"


def qwen_tts_reference(request: dict[str, Any], out: Path, timeout_s: float = 600) -> dict[str, Any]:
    """The script's result.json for `request` (its docstring says what it holds); the waveforms
    it wrote stay in `out`. RuntimeError with its stderr's end when it fails."""
    out.mkdir(parents=True, exist_ok=True)
    asked = out / "request.json"
    asked.write_text(json.dumps(request))
    run = subprocess.run(
        [str(QWEN_TTS_PYTHON), str(ROOT / "scripts" / "qwen_tts_reference.py"), str(asked), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the qwen-tts reference failed: {run.stderr[-4000:]}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result
