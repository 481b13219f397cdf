"""Edge input processors: model-specific glue run on the consumer's side, never in a hub."""

from __future__ import annotations

import torch

from omni_pipeline.payloads import InputsEmbeds, Tokens


def thinker_to_talker(payload: Tokens) -> InputsEmbeds:
    """Thinker hidden states [n, hidden] -> talker input embeddings, as Qwen2.5-Omni feeds its
    talker from the thinker's last hidden layer (here normalised; the demo talker shares the
    thinker's hidden size, so no projection is needed)."""
    hidden = payload["hidden_states"].float()
    return InputsEmbeds(inputs_embeds=torch.nn.functional.layer_norm(hidden, hidden.shape[-1:]))
