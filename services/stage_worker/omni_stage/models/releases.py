"""The real-sized checkpoints `omni models init-config-only` and `init-random` write, by name.
Apart from their writers, which load torch and transformers: the command line checks a name,
and lists the names in its help, without them."""

from __future__ import annotations

from typing import Final

OMNI_RELEASES: Final = ("qwen3-omni", "qwen2.5-omni")
"""Qwen3-Omni-30B-A3B-Instruct and Qwen2.5-Omni-7B."""
QWEN3_TTS_RELEASES: Final = {
    "qwen3-tts-1.7b-customvoice": ("1.7b", "custom_voice"),
    "qwen3-tts-1.7b-voicedesign": ("1.7b", "voice_design"),
    "qwen3-tts-1.7b-base": ("1.7b", "base"),
    "qwen3-tts-0.6b-customvoice": ("0.6b", "custom_voice"),
    "qwen3-tts-0.6b-base": ("0.6b", "base"),
}
"""Qwen/Qwen3-TTS-12Hz-*'s five checkpoints: their sizes and variants."""
REAL_SIZED: Final = (*OMNI_RELEASES, *QWEN3_TTS_RELEASES)
