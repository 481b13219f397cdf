"""Qwen2.5-Omni's audio tower run window by window: how the thinker encodes a live session's
audio while it arrives (omni_stage.engines.audio_ahead).

The tower splits each clip's features into windows of `n_window * 2` frames, and its
convolutions, attention and pooling never reach across one, so a window encoded alone gives the
rows the whole clip gives there (tests/unit/test_qwen_omni.py compares them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni_stage.models.qwen_omni.prompt import Prompts


class AudioWindows:
    """The thinker's feature extraction and audio tower, as `audio_ahead.WindowEncoder`."""

    def __init__(self, prompts: Prompts, tower: Callable[[], Any], n_window: int) -> None:
        self.prompts = prompts
        self.tower = tower
        """The loaded model's tower, looked up at each use (a sleep may drop the model)."""
        fe = prompts.features
        self.rate = int(fe.sampling_rate)
        self.window = 2 * n_window
        self._hop = int(fe.hop_length)
        self._reach = int(fe.n_fft) // 2
        """Samples a frame reads past its centre (the STFT's window is centred on it)."""

    def features(self, samples: np.ndarray) -> torch.Tensor:
        feats, mask = self.prompts.audio_features([samples])
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
        after_cnn, _ = tower._get_feat_extract_output_lengths(lengths)
        rows = tower(packed, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state
        return list(torch.split(rows, p.audio_tokens(lengths)))
