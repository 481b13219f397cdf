"""One decode step, or one prefill, for several requests of a transformers model, each with its
own KV cache.

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

Prompts that start new caches are computed together too (`prefill_together`): right-padded to
the longest, a causal forward computes each row's positions as it would alone, and each
request's cache is its row cut at its length. An eager prefill is launch-bound on a GPU at a
prompt's usual length (one kernel at a time from Python), so what a burst's first tokens
waited for was each prompt's prefill after the others'.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F

from omni_stage.engines.base import EngineError
from omni_stage.engines.last_logits import last_logits

PREFILL_BATCH_TOKENS: Final = 2048
"""`prefillBatchTokens` on CUDA: prompt positions one batched prefill computes at most."""


def prefill_budget(args: dict[str, Any], device: torch.device, stage: str) -> int:
    """An engine's `prefillBatchTokens`, checked: the prompt positions (padding included) one
    forward of the prompts that queued together computes at most (`prefill_together`, grouped
    `by_length`); 0: each prompt alone. On CUDA by default, where an eager prefill is
    launch-bound; on a CPU it is compute-bound, and served there a batch gained nothing
    (docs/benchmarks.md, "A prompt's logits at its last position")."""
    budget = args.get("prefillBatchTokens", PREFILL_BATCH_TOKENS if device.type == "cuda" else 0)
    if type(budget) is not int or budget < 0:
        raise EngineError(
            f"stage '{stage}': engine.args.prefillBatchTokens must be a whole number, 0 or more, "
            f"got {budget!r}"
        )
    return budget


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


def by_length(lengths: list[int], budget: int) -> list[list[int]]:
    """Prompts of `lengths` as the groups of their indices to prefill together: by length, each
    group's positions padded to its longest (its size times that length) within `budget`, a
    prompt longer than it alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def prefill_together(
    model: Any,
    positions: list[torch.Tensor],
    prompts: list[torch.Tensor],
    feed: str = "input_ids",
    head: torch.nn.Module | None = None,
    **inputs: Any,
) -> tuple[Any, list[Any]]:
    """`model(**inputs)` over B prompts, each the start of a new cache: `prompts[i]` row i's
    token ids ([1, n_i]), or with `feed="inputs_embeds"` its input embeddings ([1, n_i, H]);
    `positions[i]` its position ids ([1, n_i], or [k, 1, n_i] for M-RoPE's k rows).
    Right-padded to the longest, with no mask: a position attends to those before it, and the
    padding comes after every real one. Returns the model's output (row i's last position at
    n_i - 1; the padding's positions computed and meaningless) and each request's cache, its
    row cut at its length. With `head` (the model's logits' module), the logits are each row's
    last position's alone ([B, 1, vocab]; last_logits.py)."""
    from transformers import DynamicCache

    lengths = [int(p.shape[1]) for p in prompts]
    longest = max(lengths)

    def padded(p: torch.Tensor, n: int) -> torch.Tensor:  # on dim 1, the positions
        return F.pad(p, (0, 0) * (p.dim() - 2) + (0, longest - n))

    with last_logits(head, [n - 1 for n in lengths]):
        out = model(
            **inputs,
            **{feed: torch.cat([padded(p, n) for p, n in zip(prompts, lengths, strict=True)])},
            position_ids=torch.cat(
                [F.pad(p, (0, longest - n)) for p, n in zip(positions, lengths, strict=True)], dim=-2
            ),
            past_key_values=DynamicCache(),
            use_cache=True,
        )
    new = out.past_key_values
    layers = range(len(new.layers))
    split = [
        DynamicCache(
            ddp_cache_data=[
                (new.layers[i].keys[row : row + 1, :, :n], new.layers[i].values[row : row + 1, :, :n])
                for i in layers
            ]
        )
        for row, n in enumerate(lengths)
    ]
    return out, split
