"""Qwen3-Omni as stages: the MoE thinker, the talker with its code predictor, Code2Wav (see
omni_stage.models.qwen3_omni.parts)."""
