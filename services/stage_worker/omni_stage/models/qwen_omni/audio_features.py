"""What a Qwen-Omni model hears: a clip resampled to its feature extractor's rate, and the
log-mel features of clips, as the model's own processor computes them but without its padding
to a 300 s window."""

from __future__ import annotations

from typing import Any

import numpy as np
import soxr
import torch


class AudioFeatures:
    """The model's feature extractor, and what it makes of clips."""

    def __init__(self, path: str) -> None:
        from transformers import AutoFeatureExtractor

        self.extractor: Any = AutoFeatureExtractor.from_pretrained(path)
        self.rate = int(self.extractor.sampling_rate)

    def resampled(self, pcm: torch.Tensor, rate: int) -> np.ndarray:
        """A clip at the extractor's rate (as librosa does by default: soxr's HQ)."""
        samples = pcm.numpy().astype(np.float32, copy=False)
        if rate == self.rate:
            return samples
        return soxr.resample(samples, rate, self.rate, quality="HQ").astype(np.float32, copy=False)

    def of(self, audios: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-mel features and their frame mask, equal on every frame the mask keeps to what
        the model's processor computes (`padding="max_length"`: each clip padded with zeros to
        the extractor's 300 s window, ~180 ms of work a clip here whatever its length), but
        from the clips padded with zeros only as far as their last kept frame's window reaches
        (~2 ms for 5 s). A frame's values depend only on the samples in its window, and the
        floor the extractor sets from the loudest frame is the same: the frames of zeros it
        leaves out are its floor's floor (log10 of 1e-10). tests/unit/test_qwen_omni.py
        compares the two bit for bit."""
        fe = self.extractor
        clips = [a[: fe.n_samples] for a in audios]  # the processor truncates to its window too
        kept = torch.tensor([-(-len(a) // fe.hop_length) for a in clips])
        span = int(kept.max()) * fe.hop_length + fe.n_fft
        padded = [np.pad(a, (0, span - len(a))) for a in clips]
        out = fe(padded, sampling_rate=fe.sampling_rate, padding="longest", return_tensors="pt")
        frames = int(kept.max())
        mask = (torch.arange(frames)[None] < kept[:, None]).to(torch.int32)
        return out["input_features"][:, :, :frames], mask
