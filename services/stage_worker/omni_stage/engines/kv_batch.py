"""One decode step for several requests of a transformers model, each with its own KV cache.

Each request keeps its own `DynamicCache` (its length, its positions), so requests come and go
freely. For a step taken together, the caches are stacked into one batch, left-padded to the
longest, with an attention mask that hides the padding and each row's own positions; after
the forward each request gets its row back, padding cut off. This copies the caches once a
step, and a cache that grows and moves cannot be replayed as a CUDA graph: the talkers step on
a table allocated once per replica instead (`slot_cache.py`; docs/architecture.md, Talkers on
GPUs). What still steps here: the `transformers` engine's steps, the Qwen-Omni thinkers' by
default (on GPUs a thinker runs on vLLM, whose paged cache needs none, or on a slot table with
`cudaGraphs`) and the Qwen3 decoders' streamed pieces (a sliding window of 72 positions, cut
each piece).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def decode_together(
    model: Any, caches: list[Any], positions: list[torch.Tensor], **inputs: Any
) -> tuple[Any, list[Any]]:
    """`model(**inputs)` for B requests at n new positions each (the same n: one for a decode
    step): tensor `inputs` are batched on dim 0 ([B, n, ...]), others passed as they are;
    `positions[i]` is row i's position ids ([1, n], or [3, 1, n] for M-RoPE, [4, 1, n] for
    Qwen3-Omni's text and M-RoPE rows), joined on their batch dimension. Returns the model's
    output and each request's cache with the step added."""
    from transformers import DynamicCache

    lengths = [c.get_seq_length() for c in caches]
    longest = max(lengths)

    def stacked(layer: int, part: str) -> torch.Tensor:
        return torch.cat(
            [
                F.pad(getattr(c.layers[layer], part), (0, 0, longest - n, 0))
                for c, n in zip(caches, lengths, strict=True)
            ]
        )

    layers = range(len(caches[0].layers))
    past = DynamicCache(ddp_cache_data=[(stacked(i, "keys"), stacked(i, "values")) for i in layers])
    device, n_new = positions[0].device, positions[0].shape[-1]
    mask = torch.zeros(len(caches), longest + n_new, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        mask[row, longest - n :] = 1
    out = model(
        **inputs,
        attention_mask=mask,
        position_ids=torch.cat(positions, dim=-2),
        past_key_values=past,
        use_cache=True,
    )
    new = out.past_key_values
    split = [
        DynamicCache(
            ddp_cache_data=[
                (
                    new.layers[i].keys[row : row + 1, :, longest - n :],
                    new.layers[i].values[row : row + 1, :, longest - n :],
                )
                for i in layers
            ]
        )
        for row, n in enumerate(lengths)
    ]
    return out, split
