"""Payloads between stages: dicts whose tensors and lists run along units (dim 0); the keys
each kind of edge carries are `omni_pipeline.payloads`.

A unit is what a window counts: a token, a codec frame, an audio sample block. Values that
are not per-unit (ints, floats, strings, 0-d tensors) are metadata and pass through whole.
"""

from __future__ import annotations

from typing import Any

import torch

Payload = dict[str, Any]


def lead_units(p: Payload) -> int:
    """The units a stream's first payload opens with that its consumer decodes and never voices
    (`payloads.Codes.context`: a cloned voice's clip codes). A first window or first segment,
    which exist to get the first voiced units out sooner, counts its units after them."""
    return int(p.get("context") or 0)


def _per_unit(v: Any) -> bool:
    return (isinstance(v, torch.Tensor) and v.dim() > 0) or isinstance(v, list)


def concat(parts: list[Payload]) -> Payload:
    """Join payloads along units; metadata is taken from the last part that has it."""
    if len(parts) == 1:
        return parts[0]
    out: Payload = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        vals = [p[key] for p in parts if key in p]
        if isinstance(vals[0], torch.Tensor) and vals[0].dim() > 0:
            out[key] = torch.cat(vals, dim=0)
        elif isinstance(vals[0], list):
            out[key] = [x for v in vals for x in v]
        else:
            out[key] = vals[-1]
    return out


def split(p: Payload, n: int) -> tuple[Payload, Payload]:
    """The first `n` units and the rest; metadata goes to both."""
    head: Payload = {}
    tail: Payload = {}
    for k, v in p.items():
        if _per_unit(v):
            head[k], tail[k] = v[:n], v[n:]
        else:
            head[k] = tail[k] = v
    return head, tail
