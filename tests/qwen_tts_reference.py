"""The reference every Qwen3-TTS test compares with: the `qwen-tts` package's own code
(bench.qwen_tts_reference runs it in .venv-qwen-tts). Skips the test where that virtualenv was
not built (`make test` builds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.qwen_tts_reference import QWEN_TTS_PYTHON
from bench.qwen_tts_reference import qwen_tts_reference as run


def qwen_tts_reference(request: dict[str, Any], out: Path) -> dict[str, Any]:
    if not QWEN_TTS_PYTHON.exists():
        pytest.skip(f"{QWEN_TTS_PYTHON} is missing: `make qwen-tts-venv` (or `make test`) builds it")
    return run(request, out)


def waveform(out: Path, name: str) -> np.ndarray:
    """A waveform the reference wrote (float32 .npy, no pickles)."""
    return np.load(out / f"{name}.npy", allow_pickle=False)
