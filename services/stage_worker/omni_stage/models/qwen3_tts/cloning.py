"""A voice cloned from a clip (Qwen3-TTS's Base models): what the talker is given of it.

Two things are taken from the reference clip, both by transformers' own modules:
- the speaker's x-vector: the speaker encoder (`speaker_encoder.` in model.safetensors) is
  Qwen2.5-Omni's ECAPA-TDNN under the same settings' names, read from the clip's log-mel
  spectrogram (Slaney's filters, 128 bands, hop 256 at 24 kHz, as the reference computes it);
- for in-context cloning, the clip's own codes: the speech tokenizer's encoder
  (`encoder.` in speech_tokenizer/) is Mimi's, its first 16 codebooks kept, one frame per 1920
  samples (the last partial one included).
A clip at another rate is resampled to 24 kHz first (soxr, high quality: librosa's default,
which the reference calls)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Final

import numpy as np
import torch
from transformers import MimiConfig, MimiModel
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import ECAPA_TimeDelayNet

RATE: Final = 24000
SPEAKER_DEFAULTS: Final = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}
"""The speaker encoder's settings where config.json's `speaker_encoder_config` leaves one out."""
MEL: Final = {"n_fft": 1024, "hop": 256, "bands": 128, "fmax": 12000.0}


class SpeakerEncoder(ECAPA_TimeDelayNet):
    """Log-mel frames [B, frames, 128] -> the speaker's x-vector [B, enc_dim]."""

    def __init__(self, section: dict[str, Any]) -> None:
        super().__init__(SimpleNamespace(**(SPEAKER_DEFAULTS | section)))


class SpeechEncoder(MimiModel):
    """The speech tokenizer's encoder: Mimi without its decoding half (the tokenizer drops it)."""

    def __init__(self, config: MimiConfig) -> None:
        super().__init__(config)
        self.upsample = None
        self.decoder_transformer = None
        self.decoder = None


@dataclass(frozen=True, slots=True)
class ClonedVoice:
    """The speaker's x-vector [hidden]; with in-context cloning, the clip's codes [frames, 16]
    and its transcript's turn (the reference's `ref_text`), tokenized as the reference does:
    `<|im_start|>assistant\n`, the transcript, `<|im_end|>\n`."""

    x_vector: torch.Tensor
    codes: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None


def resampled(wav: torch.Tensor, rate: int) -> np.ndarray:
    """Mono float32 samples at 24 kHz, as librosa.resample makes them (soxr HQ, then its length
    fixed to the rate's ratio, rounded up)."""
    x = wav.float().numpy()
    if rate == RATE:
        return x
    import soxr

    y = soxr.resample(x, rate, RATE, quality="HQ")
    n = math.ceil(len(x) * RATE / rate)
    return np.pad(y, (0, max(0, n - len(y))))[:n]


@functools.cache
def mel_filters() -> torch.Tensor:
    """[128, 513]: Slaney's mel filters to 12 kHz (librosa's, as the reference builds them),
    built once."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=MEL["n_fft"] // 2 + 1,
        num_mel_filters=MEL["bands"],
        min_frequency=0.0,
        max_frequency=MEL["fmax"],
        sampling_rate=RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank.T.astype(np.float32))


def speaker_mels(wav: np.ndarray) -> torch.Tensor:
    """[1, frames, 128]: the log-mel spectrogram the speaker encoder reads (magnitudes of a
    1024-point STFT on reflect-padded 24 kHz samples, Slaney's filters to 12 kHz, log clamped
    at 1e-5)."""
    n_fft, hop = MEL["n_fft"], MEL["hop"]
    y = torch.from_numpy(wav)[None]
    pad = (n_fft - hop) // 2
    y = torch.nn.functional.pad(y[:, None], (pad, pad), mode="reflect")[:, 0]
    spec = torch.stft(
        y,
        n_fft,
        hop_length=hop,
        win_length=n_fft,
        window=torch.hann_window(n_fft),
        center=False,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = mel_filters() @ magnitude
    return torch.log(mel.clamp(min=1e-5)).transpose(1, 2)


class VoiceCloner(torch.nn.Module):
    """A Base checkpoint's speaker encoder and speech encoder, loaded (loading.load_cloner)."""

    def __init__(self, speaker: SpeakerEncoder, speech: SpeechEncoder, groups: int, frame: int) -> None:
        super().__init__()
        self.speaker = speaker
        self.speech = speech
        self.groups = groups
        self.frame = frame

    @torch.inference_mode()
    def clone(self, wav: torch.Tensor, rate: int, in_context: bool) -> ClonedVoice:
        """The voice of `wav` [samples] at `rate`; in context: the clip's codes too (its
        transcript's ids are the caller's to add)."""
        samples = resampled(wav, rate)
        param = next(self.speaker.parameters())
        mels = speaker_mels(samples).to(param.device, param.dtype)
        x_vector = self.speaker(mels)[0]
        return ClonedVoice(x_vector, self.codes(samples) if in_context else None)

    def codes(self, samples: np.ndarray) -> torch.Tensor:
        """[frames, 16]: the clip's codes, as the speech tokenizer's `encode` gives them."""
        param = next(self.speech.parameters())
        values = torch.from_numpy(samples)[None, None].to(param.device, param.dtype)
        frames = self.speech.encode(values, return_dict=True).audio_codes[0, : self.groups]
        return frames[:, : -(-len(samples) // self.frame)].T.cpu()
