"""A conversation's KV cache kept between its requests, by OpenAI's `prompt_cache_key`.

A live session (or any client that names a `prompt_cache_key`) sends, turn after turn, a
prompt that begins with the previous turn's prompt and reply. When a request with a key ends
complete, its replica keeps the sequence it computed (the tokens, their KV cache, and what else
the engine reads of each position again); the key's next request takes it and prefills only
the positions its prompt does not share with it. Shared means the same tokens and, at media
positions, the same media (a digest of each item: two clips of one length have the same
placeholder tokens). Reuse computes the same causal attention over the same tokens, so the
output is what a whole prefill gives. The gateway sends a key's requests to the replica that
served it last, so the sequence is found.

Bounded by the engine's arguments: at most `promptCaches` sequences a replica (default 16; 0
keeps none), the least recently used given up first, and each given up after `promptCacheIdleS`
unused (default 300), when the gateway says the key's session closed, and when the replica
sleeps. A sequence serves one request at a time: a request takes it, and puts back its own when
it ends complete, or when it was cancelled (a barge-in), once the step it was in has ended on
the compute thread (`ComputeEngine._keeping_if_cut`). Until then the key's next request waits
to take it: a barge-in's next turn comes at once, and would otherwise prefill its whole prompt
whenever it came before that step ended. A request that failed keeps nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

DEFAULT_CAPACITY: Final = 16
DEFAULT_IDLE_S: Final = 300.0
FORGOTTEN_KEPT: Final = 4096
"""Keys given up by word of their session's end, remembered so that a request of theirs still
ending (cancelled mid-step) keeps nothing after; the oldest are forgotten."""


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Where one media item sits in a prompt's ids, and a digest of its content."""

    start: int
    end: int
    digest: bytes


def digest(*tensors: torch.Tensor | None) -> bytes:
    """A digest of tensors' dtypes, shapes and contents: what tells two media items apart."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if t is None:
            h.update(b"-")
            continue
        c = t.detach().cpu().contiguous()
        h.update(f"{c.dtype}{tuple(c.shape)}".encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.digest()


@dataclass(slots=True)
class Sequence:
    """One conversation's computed sequence: its tokens, the model's cache over them, its media
    items, and per position what the engine reads again (`rows`, each [len(ids), ...])."""

    ids: list[int]
    """Its tokens (none for a stage fed embeddings: its `rows` say what it was fed)."""
    past: Any
    media: list[MediaSpan] = field(default_factory=list)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    used: float = 0.0

    @classmethod
    def left(
        cls, ids: list[int], past: Any, media: list[MediaSpan], rows: dict[str, torch.Tensor]
    ) -> Sequence:
        """What a request leaves: its sequence as far as its cache and its record of each
        position agree (a request cancelled mid-step has a cache one step past its record)."""
        n = min([past.get_seq_length(), *(len(v) for v in rows.values()), *([len(ids)] if ids else [])])
        seq = cls(ids, past, media, rows)
        seq.cut(n)
        return seq

    def shared(self, ids: list[int], media: list[MediaSpan]) -> int:
        """How many leading positions of a prompt (`ids`, its `media`) this sequence holds:
        the common tokens, cut back to the start of the first media item that differs or that
        the common part ends inside, and one short of the whole prompt (whose last position's
        logits must be computed)."""
        n = 0
        for a, b in zip(self.ids, ids, strict=False):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        for i, span in enumerate(media):
            if span.start >= n:
                break
            if span.end > n or i >= len(self.media) or self.media[i] != span:
                return span.start
        return max(n, 0)

    def cut(self, n: int) -> None:
        """Keep the first `n` positions only."""
        if (drop := self.past.get_seq_length() - n) > 0:
            self.past.crop(-drop)
        self.ids = self.ids[:n]
        self.media = [m for m in self.media if m.end <= n]
        self.rows = {k: v[:n] for k, v in self.rows.items()}


def same_rows(kept: torch.Tensor, new: torch.Tensor) -> int:
    """How many leading rows two sequences of input embeddings share, bit for bit (a stage fed
    embeddings, not tokens, matches its kept sequence by them)."""
    m = min(len(kept), len(new))
    differ = (kept[:m] != new[:m].to(kept.device, kept.dtype)).any(-1).nonzero()
    return int(differ[0]) if len(differ) else m


class PromptCaches:
    """A replica's kept sequences, by `prompt_cache_key`; see the module's docstring."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, idle_s: float = DEFAULT_IDLE_S) -> None:
        if capacity < 0 or idle_s <= 0:
            raise ValueError("promptCaches must be at least 0 and promptCacheIdleS more than 0")
        self.capacity = capacity
        self.idle_s = idle_s
        self._kept: OrderedDict[str, Sequence] = OrderedDict()
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self._cut: dict[str, asyncio.Event] = {}
        """Keys whose request was cut mid-step: set once what it made is kept (or not)."""
        self.reused_tokens = 0
        """Prompt positions not computed again, since the start (a metric)."""

    def __len__(self) -> int:
        return len(self._kept)

    async def take(self, key: str | None) -> Sequence | None:
        """The key's sequence, now the caller's alone (None: none kept, or the key is None); once
        a request of the key that was cut mid-step has kept what it made (`cut_mid_step`)."""
        if key is None:
            return None
        if (kept := self._cut.get(key)) is not None:
            await kept.wait()
        self.expire()
        return self._kept.pop(key, None)

    def cut_mid_step(self, key: str) -> Callable[[], None]:
        """A request of `key` was cut mid-step: what it made is kept once that step ends. The
        key's next request waits (`take`) until the call returned here, made after the keep."""
        kept = self._cut[key] = asyncio.Event()

        def settled() -> None:
            kept.set()
            if self._cut.get(key) is kept:
                del self._cut[key]

        return settled

    def keep(self, key: str | None, seq: Sequence) -> None:
        """Keep a request's sequence for the key's next request, giving up the least recently
        used beyond the capacity."""
        if key is None or self.capacity == 0 or key in self._forgotten:
            return
        seq.used = time.monotonic()
        self._kept.pop(key, None)
        self._kept[key] = seq
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        self.expire()

    def forget(self, key: str) -> bool:
        """The key's conversation ended: its sequence goes, and none is kept for it again."""
        self._forgotten[key] = None
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        return self._kept.pop(key, None) is not None

    def clear(self) -> None:
        self._kept.clear()

    def expire(self) -> int:
        """Give up the sequences unused for `idle_s`; how many."""
        until = time.monotonic() - self.idle_s
        stale = [k for k, s in self._kept.items() if s.used < until]
        for k in stale:
            del self._kept[k]
        return len(stale)
