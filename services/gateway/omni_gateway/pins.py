"""Where a conversation's requests run: a `prompt_cache_key`'s replicas, remembered so its next
turn goes back to the replica that kept its sequence (and a live session's audio, sent ahead,
to the replica its response will read it on)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

CONVERSATIONS_PINNED: Final = 4096
"""Conversations whose replicas a gateway remembers; the oldest forgotten."""


class ConversationPins:
    """By conversation, the instance of each stage its last request ran on; bounded, oldest out."""

    def __init__(self, capacity: int = CONVERSATIONS_PINNED) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[str, dict[str, str]] = OrderedDict()

    def route(self, key: str | None) -> dict[str, str]:
        """The instances the conversation last ran on, by stage (none for no conversation)."""
        return {} if key is None else self._routes.get(key, {})

    def remember(self, key: str, route: dict[str, str]) -> None:
        """The conversation's request ran on this route: its next one goes there too (where
        the replicas have room)."""
        self._routes.pop(key, None)
        self._routes[key] = route
        while len(self._routes) > self.capacity:
            self._routes.popitem(last=False)

    def pin(self, key: str, stage: str, instance: str) -> None:
        """The conversation's next request runs `stage` on `instance` (a live session's audio
        went there ahead of it)."""
        self.remember(key, self.route(key) | {stage: instance})

    def forget(self, key: str) -> None:
        """The conversation ended: its pins go."""
        self._routes.pop(key, None)

    def __len__(self) -> int:
        return len(self._routes)
