"""A Qwen-Omni audio tower run window by window: how the thinker encodes a live session's
audio while it arrives (omni_stage.engines.audio_ahead).

Neither tower reaches across a window of its own: Qwen2.5-Omni's convolves, attends and pools
within `n_window * 2` frames (2 s), Qwen3-Omni's convolves within `n_window * 2` and attends
within `n_window_infer` frames (8 s). So a window encoded alone gives the rows the whole clip
gives there (tests/unit/test_qwen_omni.py and test_qwen3_omni.py compare them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_stage.models.qwen_omni.prompt import Prompts


def tower_window(audio_config: Any) -> int:
    """Feature frames a Qwen-Omni audio tower never reaches across: Qwen3-Omni's attends within
    `n_window_infer`, Qwen2.5-Omni's (which has none) within `n_window * 2`."""
    return int(getattr(audio_config, "n_window_infer", 0) or 2 * audio_config.n_window)


class AudioWindows:
    """A Qwen part's feature extraction and audio tower, as `audio_ahead.WindowEncoder`."""

    def __init__(self, prompts: Prompts, tower: Callable[[], Any], audio_config: Any) -> None:
        self.prompts = prompts
        self.tower = tower
        """The loaded model's tower, looked up at each use (a sleep may drop the model)."""
        fe = prompts.audio.extractor
        self.rate = prompts.audio.rate
        self.window = tower_window(audio_config)
        self._hop = int(fe.hop_length)
        self._reach = int(fe.n_fft) // 2
        """Samples a frame reads past its centre (the STFT's window is centred on it)."""

    def features(self, samples: np.ndarray) -> torch.Tensor:
        feats, mask = self.prompts.audio.of([samples])
        return feats[0, :, : int(mask.sum())].to(self.prompts.dtype)

    def final_frames(self, samples: int) -> int:
        # Frame j reads samples up to j * hop + reach - 1.
        return 0 if samples < self._reach else (samples - self._reach) // self._hop + 1

    @torch.inference_mode()
    def encode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        tower = self.tower()
        p = self.prompts
        lengths = torch.tensor([w.shape[-1] for w in windows], device=p.device)
        packed = torch.cat(windows, dim=-1).to(p.device, p.dtype)
        rows = tower(packed, feature_lens=lengths).last_hidden_state  # both read the lengths alone
        return list(torch.split(rows, p.audio_tokens(lengths)))
