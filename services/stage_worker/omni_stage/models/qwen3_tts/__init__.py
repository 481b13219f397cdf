"""Qwen3-TTS: a talker with a multi-codebook code predictor (Qwen3-Omni's shape, sharing its
frames) and the 12 Hz speech tokenizer's decoder, served as talker -> code2wav (docs/models.md)."""
