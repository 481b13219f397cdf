"""What the client played of a live session's latest answer (the duplex dialect's
`playback.ack`), and what of that answer the conversation keeps when the user cuts in: what was
heard, not what was sent. A session whose client never acknowledges (GA's) keeps what was sent,
as OpenAI's does until the client truncates it."""

from __future__ import annotations

from typing import Any

from omni_gateway.realtime.conversation import pcm_ms, truncate
from omni_gateway.realtime.duplex_protocol import PlaybackAck, PlaybackPolicy
from omni_gateway.realtime.protocol import RealtimeError
from omni_gateway.realtime.response import Response


class Playback:
    """The latest response and how much of it the client says it played."""

    def __init__(self) -> None:
        self.policy: PlaybackPolicy = "commit_all_on_done"
        self.latest: Response | None = None
        """The latest response: the one playback acks are about."""
        self.played_ms: int | None = None
        """What the client last said it played of it (None: nothing said)."""

    def started(self, response: Response | None) -> None:
        self.latest, self.played_ms = response, None

    def ack(self, ack: PlaybackAck) -> dict[str, Any]:
        """Take the client's word for what it played; returns the cursor it is told back."""
        r = self.latest
        if r is None or (ack.response_id is not None and ack.response_id != r.id):
            raise RealtimeError(
                "response_id: not the session's latest response",
                code="playback_item_not_found",
                param="response_id",
            )
        if ack.item_id is not None and ack.item_id != r.item.id:
            raise RealtimeError(
                f"item_id: response {r.id}'s item is {r.item.id}",
                code="playback_item_mismatch",
                param="item_id",
            )
        sent = pcm_ms(r.part.audio_bytes)
        played = min(ack.played_ms, sent)
        committed = min(ack.committed_ms if ack.committed_ms is not None else played, played)
        self.played_ms = max(self.played_ms or 0, committed)
        return {
            "response_id": r.id,
            "item_id": r.item.id,
            "played_ms": played,
            "committed_ms": self.played_ms,
            "sent_ms": sent,
        }

    def cut(self) -> tuple[str, int] | None:
        """Cut the latest answer's item to what the client said it played (as its own
        conversation.item.truncate would): its id and where it now ends, or None if nothing was
        cut. Without an ack it keeps what was sent, except under `ack_only` (nothing heard)."""
        r, played = self.latest, self.played_ms
        if played is None and self.policy == "ack_only":
            played = 0
        if r is None or played is None or not r.speaks or played >= pcm_ms(r.part.audio_bytes):
            return None
        truncate(r.item, 0, played)
        return r.item.id, played
