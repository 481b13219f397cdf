"""One decode step for several requests of a transformers model, each with its own KV cache.

Each request keeps its own `DynamicCache` (its length, its positions), so requests come and go
freely. For a step taken together, the caches are stacked into one batch, left-padded to the
longest, with an attention mask that hides the padding and each row's own positions; after
the forward each request gets its row back, padding cut off. This copies the caches once a
step (half of a batch-8 talker step on the CPU, a quarter on a GPU: `omni bench step`), and a
cache that grows and moves cannot be replayed as a CUDA graph: a cache allocated once per
replica replaces it (docs/architecture.md, Talkers on GPUs; not built yet).
"""

from __future__ import annotations

from collections.abc import Callable
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


def warm_up(model: Any, width: int, positions: Callable[[int, int], torch.Tensor], **inputs: Any) -> None:
    """Run `model` (a decoder taking `inputs_embeds` of `width`) on zeros through a request's
    life as a decoding stage runs it, with `inputs` besides: a prefill, a step on the prefill's
    cache, a step on a step's, a step together with another request (`decode_together`), a
    step on what that left, a prefill on a kept cache (a conversation's next turn). What
    `torch.compile` wraps in it compiles now, at start, not at the first requests: each form
    passes the model tensors of its own strides and a mask or none, which a compile is guarded
    on; with dynamic shapes one compile of each form serves every length and batch.
    `positions(at, n)` gives the position ids of n positions from `at`."""
    p = next(model.parameters())
    x = torch.zeros(1, 4, width, dtype=p.dtype, device=p.device)

    def forward(n: int, past: Any) -> Any:
        at = 0 if past is None else past.get_seq_length()
        out = model(
            inputs_embeds=x[:, :n],
            position_ids=positions(at, n),
            past_key_values=past,
            use_cache=True,
            **inputs,
        )
        return out.past_key_values

    one = forward(1, forward(1, forward(4, None)))
    caches = [one, forward(3, None)]
    _, caches = decode_together(
        model,
        caches,
        [positions(c.get_seq_length(), 1) for c in caches],
        inputs_embeds=torch.cat([x[:, :1], x[:, :1]]),
        **inputs,
    )
    forward(2, forward(1, caches[0]))
