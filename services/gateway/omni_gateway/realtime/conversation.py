"""A live session's conversation: its items in order, the audio buffer a user's turn is spoken
into, and the chat messages a response runs the pipeline over.

The pipeline hears a user's audio as a chat `input_audio` part (WAV of the turn's PCM), so it
passes the same checks and decoding as a chat request's audio. An assistant's earlier turn
enters as its text (its transcript, cut where the client said playback stopped), as the
model's chat template has assistant turns.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, Final

from omni_gateway.audio import wav_bytes
from omni_gateway.realtime.protocol import PCM_RATE, ContentPart, Item, RealtimeError, new_id

BYTES_PER_MS: Final = PCM_RATE * 2 // 1000
"""PCM16 mono at 24 kHz."""
MAX_ITEMS: Final = 512
"""Items a conversation holds; a client deletes old ones to go on past it."""


def pcm_ms(pcm: bytes | int) -> int:
    return (pcm if isinstance(pcm, int) else len(pcm)) // BYTES_PER_MS


def decode_pcm(b64: str, param: str) -> bytes:
    """Base64 PCM16 (whole samples) from a client, or RealtimeError naming `param`."""
    try:
        pcm = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{param}: not base64", code="invalid_audio", param=param) from None
    if len(pcm) % 2:
        raise RealtimeError(
            f"{param}: an odd number of bytes is not 16-bit PCM", code="invalid_audio", param=param
        )
    return pcm


@dataclass
class Part:
    type: str
    """input_text, input_audio, input_image (a user's); output_text, output_audio (an assistant's)."""
    text: str | None = None
    pcm: bytes = b""
    """A user's audio; an assistant's is not kept (its length is, in `audio_bytes`)."""
    transcript: str | None = None
    image_url: str | None = None
    audio_bytes: int = 0
    """Of an assistant's audio: what was sent to the client."""

    def wire(self) -> dict[str, Any]:
        """As events show it: the audio itself left out."""
        shown: dict[str, Any] = {"type": self.type}
        if self.type in ("input_text", "output_text"):
            shown["text"] = self.text or ""
        elif self.type in ("input_audio", "output_audio"):
            shown["transcript"] = self.transcript
        elif self.type == "input_image":
            shown["image_url"] = self.image_url
        return shown

    def said(self) -> str:
        return (self.text if self.type.endswith("text") else self.transcript) or ""


@dataclass
class ConversationItem:
    role: str
    parts: list[Part]
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [p.wire() for p in self.parts],
        }

    def message(self) -> dict[str, Any] | None:
        """The chat message the pipeline reads; None for an item with nothing to read."""
        if self.role != "user":
            text = "".join(p.said() for p in self.parts)
            return {"role": self.role, "content": text} if text else None
        content: list[dict[str, Any]] = []
        for p in self.parts:
            if p.type == "input_text":
                content.append({"type": "text", "text": p.text or ""})
            elif p.type == "input_audio":
                data = base64.b64encode(wav_bytes(p.pcm, PCM_RATE)).decode()
                content.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
            elif p.type == "input_image":
                content.append({"type": "image_url", "image_url": {"url": p.image_url}})
        return {"role": "user", "content": content} if content else None


def item_from_client(item: Item, param: str) -> ConversationItem:
    """A client's item, checked: each part of a type its role has, with what that type needs."""
    allowed = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text", "text")}
    allowed["assistant"] = ("output_text", "output_audio", "text", "audio")
    parts = []
    for i, c in enumerate(item.content):
        where = f"{param}.content.{i}"
        if c.type not in allowed[item.role]:
            raise RealtimeError(
                f"{where}.type: a {item.role} item's content is {', '.join(allowed[item.role])}",
                param=f"{where}.type",
            )
        parts.append(_part(c, where))
    if not parts:
        raise RealtimeError(f"{param}.content: an item has content", param=f"{param}.content")
    if item.id is not None and not (0 < len(item.id) <= 32):
        raise RealtimeError(f"{param}.id: 1 to 32 characters", param=f"{param}.id")
    made = ConversationItem(item.role, parts, status="completed")
    if item.id is not None:
        made.id = item.id
    return made


def _part(c: ContentPart, where: str) -> Part:
    kind = {"text": "output_text", "audio": "output_audio"}.get(c.type, c.type)
    if kind in ("input_text", "output_text"):
        if c.text is None:
            raise RealtimeError(f"{where}.text: a text part has text", param=f"{where}.text")
        return Part(kind, text=c.text)
    if kind == "input_audio":
        if c.audio is None:
            raise RealtimeError(f"{where}.audio: an input_audio part has audio", param=f"{where}.audio")
        pcm = decode_pcm(c.audio, f"{where}.audio")
        if not pcm:
            raise RealtimeError(f"{where}.audio: no samples", code="invalid_audio", param=f"{where}.audio")
        return Part(kind, pcm=pcm, transcript=c.transcript)
    if kind == "output_audio":  # the model reads its text only
        size = len(decode_pcm(c.audio, f"{where}.audio")) if c.audio else 0
        return Part(kind, transcript=c.transcript or "", audio_bytes=size)
    if c.detail not in (None, "auto"):
        raise RealtimeError(f"{where}.detail: only 'auto' is served", param=f"{where}.detail")
    if not c.image_url:
        raise RealtimeError(
            f"{where}.image_url: an input_image part has an image_url", param=f"{where}.image_url"
        )
    return Part(kind, image_url=c.image_url)


class AudioBuffer:
    """The user's audio since the last commit or clear, up to `max_bytes`. Positions are ms of all
    the audio appended in the session (where VAD's marks fall)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pcm = bytearray()
        self._start = 0
        """Where the buffer begins, in bytes of all the audio appended."""
        self._sent_from, self._sent = -1, 0
        """Where the buffer began when its audio was last sent ahead, and how much of it was."""

    @property
    def size(self) -> int:
        return len(self._pcm)

    @property
    def start_ms(self) -> int:
        return self._start // BYTES_PER_MS

    @property
    def end_ms(self) -> int:
        return (self._start + len(self._pcm)) // BYTES_PER_MS

    def append(self, pcm: bytes) -> None:
        if len(self._pcm) + len(pcm) > self.max_bytes:
            raise RealtimeError(
                f"audio: the input buffer holds {pcm_ms(self.max_bytes) / 1000:g} s at most; commit it",
                code="input_audio_buffer_full",
                param="audio",
            )
        self._pcm += pcm

    def take(self, until_ms: int | None = None) -> bytes:
        """The audio up to `until_ms` (None: all of it), out of the buffer."""
        end = len(self._pcm) if until_ms is None else self._offset(until_ms)
        pcm = bytes(self._pcm[:end])
        del self._pcm[:end]
        self._start += end
        return pcm

    def keep_from(self, ms: int) -> None:
        """Drop the audio before `ms` (VAD: what came before a turn's padding)."""
        self.take(ms)

    def clear(self) -> None:
        self.take()

    def unsent(self) -> tuple[int, bytes]:
        """The audio not yet sent ahead to be encoded (UserInput.settle), and where
        in the buffer it begins (bytes), now marked sent. Once the buffer's start moves (a
        commit, a clear, VAD's trim), all of it is unsent again: its turn begins anew."""
        if self._sent_from != self._start:
            self._sent_from, self._sent = self._start, 0
        at, self._sent = self._sent, len(self._pcm)
        return at, bytes(self._pcm[at:])

    def _offset(self, ms: int) -> int:
        return min(max(ms * BYTES_PER_MS - self._start, 0), len(self._pcm)) // 2 * 2


class Conversation:
    """The session's items, in order."""

    def __init__(self) -> None:
        self.items: list[ConversationItem] = []

    def add(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` ("root": first; None: last); returns the id before it."""
        if any(i.id == item.id for i in self.items):
            raise RealtimeError(f"item.id: '{item.id}' is already in the conversation", param="item.id")
        if len(self.items) >= MAX_ITEMS:
            raise RealtimeError(
                f"the conversation holds at most {MAX_ITEMS} items; delete some first",
                code="conversation_full",
            )
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def index(self, item_id: str, param: str = "item_id") -> int:
        for n, item in enumerate(self.items):
            if item.id == item_id:
                return n
        raise RealtimeError(
            f"{param}: no item '{item_id}' in the conversation", code="item_not_found", param=param
        )

    def get(self, item_id: str) -> ConversationItem:
        return self.items[self.index(item_id)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id)]


def messages(instructions: str, items: list[ConversationItem], max_media: int) -> list[dict[str, Any]]:
    """The chat a response runs over: the instructions as its system message, then the latest
    items that hold at most `max_media` media parts between them (the gateway's limit for one
    request); earlier ones drop out of the prompt, not out of the conversation (OpenAI's
    `truncation: auto`)."""
    kept: list[dict[str, Any]] = []
    media = 0
    for item in reversed(items):
        if (m := item.message()) is None:
            continue
        media += sum(1 for p in item.parts if p.type in ("input_audio", "input_image"))
        if media > max_media:
            break
        kept.append(m)
    chat = [{"role": "system", "content": instructions}] if instructions else []
    return chat + kept[::-1]


def truncate(item: ConversationItem, content_index: int, audio_end_ms: int) -> None:
    """Cut an assistant's audio part at `audio_end_ms` of what was sent, and its transcript where
    the same share of it ends (at a word's end): the model's next turn reads only what the
    user heard. The words' own timing is not known here; the share is an estimate."""
    if item.role != "assistant":
        raise RealtimeError("item_id: only an assistant's audio can be truncated", param="item_id")
    if not 0 <= content_index < len(item.parts) or item.parts[content_index].type != "output_audio":
        raise RealtimeError("content_index: not an audio part of the item", param="content_index")
    part = item.parts[content_index]
    sent = pcm_ms(part.audio_bytes)
    if audio_end_ms < 0 or audio_end_ms > sent:
        raise RealtimeError(
            f"audio_end_ms: {audio_end_ms} is outside the item's {sent} ms of audio", param="audio_end_ms"
        )
    text = part.transcript or ""
    keep = len(text) * audio_end_ms // sent if sent else 0
    cut = text[:keep]
    if keep < len(text) and not text[keep].isspace():
        cut = cut.rsplit(" ", 1)[0] if " " in cut else ""
    part.transcript = cut.rstrip()
    part.audio_bytes = audio_end_ms * BYTES_PER_MS
