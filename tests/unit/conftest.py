"""What the unit tests of a KV cache's handling (the slot table, prompts prefilled together)
share: the plain forward they compare with."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2Model


@pytest.fixture(scope="module")
def decoder() -> Qwen2Model:
    """A small Qwen2 decoder of transformers, width 32, random weights (what is compared is the
    cache, not the model)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=16,
    )
    return Qwen2Model(config).eval()
