"""The Qwen-Omni parts both families build on (Qwen2.5-Omni, Qwen3-Omni): the part base, the
thinker, the audio and vision encoder stage, the prompt and media glue around transformers'
processors, and what their tiny checkpoints share."""
