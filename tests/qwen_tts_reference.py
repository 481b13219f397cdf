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


def pcm16(wav: np.ndarray) -> np.ndarray:
    """The reference's float samples as the gateway writes them (its own conversion)."""
    from omni_gateway.audio import to_pcm16

    return np.frombuffer(to_pcm16(wav), dtype="<i2")


def same_speech(ours: np.ndarray, expected: np.ndarray, codes: int) -> None:
    """16-bit audio served equal to the reference's, `codes` frames long."""
    assert ours.shape == expected.shape == (codes * 1920,)
    assert int(np.abs(ours.astype(np.int32) - expected).max()) <= 1  # float rounding at a step's edge


def spoken_on_socket(base: str, config: dict[str, Any], text: str) -> np.ndarray:
    """One utterance on vLLM-Omni's speech socket (`/v1/audio/speech/stream`) as its clients
    speak it: the session.config, the text, input.done; its 16-bit PCM, checked to come as one
    audio.start, the audio, audio.done (its byte count) and session.done."""
    import json

    from websockets.sync.client import connect

    with connect(f"{base.replace('http://', 'ws://')}/v1/audio/speech/stream", max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "response_format": "pcm", **config}))
        ws.send(json.dumps({"type": "input.text", "text": text}))
        ws.send(json.dumps({"type": "input.done"}))
        start, audio, done, flushed = (ws.recv() for _ in range(4))
    assert json.loads(start)["type"] == "audio.start" and json.loads(flushed)["type"] == "session.done"
    assert isinstance(audio, bytes) and json.loads(done)["total_bytes"] == len(audio)
    return np.frombuffer(audio, dtype="<i2")
