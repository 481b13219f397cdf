"""A full-duplex session, in vLLM-Omni's dialect: a live session (omni_gateway.realtime.live)
that outlives its socket.

Its server events are numbered and journaled until acknowledged, so a client whose socket drops
resumes on another (`session.resume`) and gets what it missed, in order. The client tells it how
much of each answer it played (`playback.ack`), so when the user cuts in (`barge_in`, or speech
heard by server VAD) the conversation keeps what the user heard, not what was sent. And it takes
the dialect's input: audio at the client's rate, typed text into the user's turn, commits that
end an item without ending the turn.

No model served here decides turns while it speaks, so a session is vLLM-Omni's documented
fallback, turn-based duplex (`implementation_level: turn_based_duplex`): it listens all the time
(audio appended during an answer is heard, by VAD where it is on), and a turn ends at a commit
or at VAD's end of speech.
"""

from __future__ import annotations

import time
from typing import Any, Final

import msgspec

from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.duplex_input import DuplexAudio
from omni_gateway.realtime.duplex_protocol import (
    CAPABILITIES,
    DUPLEX_DECODER,
    OUTPUT_RATE,
    PCM16,
    BargeIn,
    DuplexAppend,
    DuplexCommit,
    DuplexSessionConfig,
    DuplexSessionUpdate,
    EventAck,
    Heartbeat,
    InputCancel,
    OverlapPolicy,
    PlaybackAck,
    SessionClose,
    SessionResume,
    TextAppend,
)
from omni_gateway.realtime.link import Attachment, Hello, Link
from omni_gateway.realtime.live import LiveSession
from omni_gateway.realtime.protocol import (
    AudioClear,
    RealtimeError,
    ResponseParams,
    new_id,
    parse_event,
)
from omni_gateway.realtime.response import Responses
from omni_gateway.realtime.session import session_wire
from omni_gateway.realtime.settings import Settings, SettingsRules

_OUTPUT_DELTAS: Final = frozenset(
    {
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_text.delta",
    }
)


MAX_TYPED: Final = 65536
"""Characters typed into one user turn (input.text.append) before its commit."""


"""Characters typed into one user turn (input.text.append) before its commit."""


class DuplexSession:
    """A live session of the duplex dialect; LiveSessions holds it while its socket is away."""

    def __init__(
        self,
        pipeline: Pipeline,
        max_buffer_bytes: int,
        metrics: GatewayMetrics,
        journal_bytes: int,
        max_idle_s: float,
    ) -> None:
        self.live = live = LiveSession(pipeline, self._deliver, max_buffer_bytes, metrics)
        self.id = live.id
        self.link = Link(self.id, journal_bytes)
        live.settings.turn_detection = None  # the dialect's default: the client commits
        self.ended: str | None = None
        """Why the client ended the session (`session.close`), or why the gateway did."""
        self.started = time.monotonic()
        self.max_idle_s = max_idle_s
        self.idle_timeout_s: float | None = None
        """The client's own idle limit (at most the gateway's); None: the gateway's."""
        self.auto_response = True
        self.overlap_policy: OverlapPolicy | None = None
        """None: VAD's own `interrupt_response` decides."""
        self.audio = DuplexAudio(live)
        self._spoken: str | None = None
        """The response whose speak decision went out."""

    @property
    def responses(self) -> Responses:
        return self.live.responses

    @property
    def idle_s(self) -> float:
        return self.idle_timeout_s or self.max_idle_s

    # --- the socket's side -------------------------------------------------------------------

    async def start(self, socket: Attachment) -> None:
        """On its first socket: session.created, with the token to resume it."""
        await self.live.detect_turns()
        await self.link.attach(socket, self._hello("session.created"))

    async def resume(self, socket: Attachment, token: str, last_seq: int) -> Attachment | None:
        """Onto `socket` (Link.resume): session.resumed, then what the client missed."""
        return await self.link.resume(socket, token, last_seq, self._hello("session.resumed"))

    @property
    def resumable(self) -> bool:
        return not self.link.journal.overflowed and self.ended is None

    async def receive(self, data: str | bytes) -> None:
        await self.live.receive(data, lambda d: parse_event(d, DUPLEX_DECODER), self._handle)

    async def finish(self, reason: str) -> None:
        """The session ends: its answer in progress first (cancelled, said), then
        session.closed says why, its last event; the socket's handler closes the socket."""
        if self.ended is None:
            self.ended = reason
            await self.live.cancel("client_cancelled")
            await self.live.emit("session.closed", session_id=self.id, reason=reason, event={})

    async def close(self) -> None:
        await self.live.close()

    # --- what goes out -----------------------------------------------------------------------

    def _hello(self, type_: str) -> Hello:
        def hello(token: str, generation: int) -> dict[str, Any]:
            return {
                "type": type_,
                "event_id": new_id("event"),
                "session_id": self.id,
                "session": self.session_wire(),
                "resume_token": token,
                "attachment_generation": generation,
            }

        return hello

    async def _deliver(self, event: dict[str, Any]) -> None:
        """Each event onto the link, with the dialect's additions to GA's events: a response's
        id at the top of its created and done, the speak decision before its first output, each
        audio delta's format."""
        kind = event["type"]
        if kind in ("response.created", "response.done"):
            event["response_id"] = event["response"]["id"]
        elif kind in _OUTPUT_DELTAS and event["response_id"] != self._spoken:
            self._spoken = event["response_id"]
            speak = {
                "type": "response.speak",
                "event_id": new_id("event"),
                "response_id": self._spoken,
                "item_id": event["item_id"],
                "metadata": {"implementation_level": CAPABILITIES["implementation_level"]},
            }
            await self.link.deliver(speak)
        if kind == "response.output_audio.delta":
            event.update(format=PCM16, sample_rate_hz=OUTPUT_RATE)
        await self.link.deliver(event)

    def session_wire(self) -> dict[str, Any]:
        wire = session_wire(self.live)
        s = self.live.settings
        audio_in, audio_out = wire["audio"]["input"], wire["audio"]["output"]
        audio_in.update(format={"type": "audio/pcm", "rate": self.audio.rate}, sample_rate_hz=self.audio.rate)
        audio_out["sample_rate_hz"] = OUTPUT_RATE
        wire.update(
            session_id=self.id,
            modalities=["audio", "text"] if "audio" in s.output_modalities else ["text"],
            input_audio_format=PCM16,
            output_audio_format=PCM16,
            sample_rate_hz=self.audio.rate,
            turn_detection=audio_in["turn_detection"],
            voice=s.voice,
            temperature=s.temperature,
            idle_timeout_s=self.idle_s,
            overlap_policy=self.overlap_policy,
            playback_commit_policy=self.live.playback.policy,
            extra_body={"auto_response": self.auto_response},
            capabilities=CAPABILITIES,
        )
        return wire

    # --- client events -----------------------------------------------------------------------

    async def _handle(self, event: Any) -> None:
        live = self.live
        match event:
            case DuplexSessionUpdate(session=config):
                before = live.settings.turn_detection
                await self.configure(config)
                if live.settings.turn_detection != before:
                    await live.detect_turns()
                await live.emit("session.updated", session=self.session_wire())
            case DuplexAppend():
                await self.audio.append(event)
            case DuplexCommit():
                await self._commit(event)
            case AudioClear() | InputCancel():
                self.audio.clear()
                await live.emit("input_audio_buffer.cleared")
            case TextAppend(text=text):
                if sum(map(len, live.input.typed)) + len(text) > MAX_TYPED:
                    raise RealtimeError(
                        f"text: a turn holds {MAX_TYPED} typed characters at most; commit it",
                        code="input_text_too_long",
                        param="text",
                    )
                live.input.typed.append(text)
            case PlaybackAck():
                await live.emit("playback.acknowledged", event=live.playback.ack(event))
            case BargeIn():
                await live.barge_in()
            case EventAck(server_event_seq=seq):
                try:
                    self.link.journal.acknowledge(seq)
                except ValueError as exc:
                    raise RealtimeError(
                        str(exc), code="invalid_event_ack", param="server_event_seq"
                    ) from None
            case Heartbeat():
                await live.emit("session.heartbeat_ack", session_id=self.id)
            case SessionClose(reason=reason):
                await self.finish(reason)
            case SessionResume():
                raise RealtimeError(
                    "session.resume is a new connection's first message", code="unsupported_session_resume"
                )
            case _:
                await live.handle(event)

    async def configure(self, c: DuplexSessionConfig) -> None:
        """Check every field first, then set them: an update is taken whole or not at all."""
        unset, live = msgspec.UNSET, self.live
        s = configured(live.settings.copy(), c, live.rules)
        rate = self.audio.rate
        rates = [(c.sample_rate_hz, "session.sample_rate_hz")]
        if c.audio is not unset and c.audio.input is not unset:
            rates.append((c.audio.input.sample_rate_hz, "session.audio.input.sample_rate_hz"))
        asked_rates = {r for r, _ in rates if r is not unset}
        if len(asked_rates) > 1:
            raise RealtimeError(
                "session.audio.input.sample_rate_hz: differs from session.sample_rate_hz",
                param="session.audio.input.sample_rate_hz",
            )
        if asked_rates:
            rate = asked_rates.pop()
        idle = self.idle_timeout_s
        if c.idle_timeout_s is not unset:
            if c.idle_timeout_s > self.max_idle_s:
                raise RealtimeError(
                    f"session.idle_timeout_s: at most {self.max_idle_s:g} (this gateway's idle limit)",
                    param="session.idle_timeout_s",
                )
            idle = c.idle_timeout_s
        auto = self.auto_response
        if c.extra_body is not unset and c.extra_body.auto_response is not unset:
            auto = c.extra_body.auto_response
        overlap = self.overlap_policy if c.overlap_policy is unset else c.overlap_policy
        if overlap is not None and s.turn_detection is not None:
            interrupt = overlap == "barge_in_on_speech"
            s.turn_detection = msgspec.structs.replace(s.turn_detection, interrupt_response=interrupt)
        elif overlap == "barge_in_on_speech":
            raise RealtimeError(
                "session.overlap_policy: barge_in_on_speech hears speech by server VAD: "
                "set turn_detection to server_vad (or send barge_in)",
                param="session.overlap_policy",
            )
        playback = live.playback.policy if c.playback_commit_policy is unset else c.playback_commit_policy
        await self.audio.set_rate(rate)
        live.settings, self.idle_timeout_s = s, idle
        self.auto_response, self.overlap_policy, live.playback.policy = auto, overlap, playback

    # --- the user's turn ---------------------------------------------------------------------

    async def _commit(self, c: DuplexCommit) -> None:
        """A final commit ends the user's turn, and is answered unless the client says not
        (`response_create`) or turned `auto_response` off; any other is the decision to listen.
        Audio the client marked as not speech (only such audio, or the commit's `is_speech:
        false`) makes no item: it is dropped, and the session listens on."""
        await self.audio.flush()
        if self.audio.only_silence(c.is_speech):
            self.audio.clear()
            await self._listen(c.final, "not_speech")
            return
        await self.live.commit()
        self.audio.spoke = False
        if c.response_create if c.response_create is not None else c.final and self.auto_response:
            await self.live.create_response(ResponseParams())
            return
        await self._listen(c.final, "commit")

    async def _listen(self, final: bool, reason: str) -> None:
        listening = {
            "object": "realtime.response",
            "status": "listening",
            "metadata": {"final": final, "reason": reason},
        }
        await self.live.emit("response.listen", session_id=self.id, response=listening)


def configured(s: Settings, c: DuplexSessionConfig, rules: SettingsRules) -> Settings:
    """The duplex `session.update`'s settings over `s` (a copy): the dialect's aliases of GA's
    fields (`modalities`, `max_response_output_tokens`, `voice`, `turn_detection` at the top)."""
    unset = msgspec.UNSET
    if c.model is not unset:
        rules.model(c.model, "session.model")
    for name in ("output_modalities", "modalities"):
        if (asked := getattr(c, name)) is not unset:
            speech = ["audio"] if "audio" in asked else ["text"]  # audio is spoken with its transcript
            s.output_modalities = rules.modalities(speech, f"session.{name}")
            break
    if c.instructions is not unset:
        s.instructions = c.instructions
    if c.temperature is not unset:
        s.temperature = c.temperature
    for name in ("max_output_tokens", "max_response_output_tokens"):
        if (asked := getattr(c, name)) is not unset:
            s.max_output_tokens = rules.max_tokens(asked, f"session.{name}")
    audio_in = c.audio.input if c.audio is not unset else unset
    audio_out = c.audio.output if c.audio is not unset else unset
    voices = [(c.voice, "session.voice")]
    if audio_out is not unset:
        voices.append((audio_out.voice, "session.audio.output.voice"))
    for voice, param in voices:
        if voice is not unset:
            s.voice = rules.voice(voice, param)
    for turn in (c.turn_detection, audio_in.turn_detection if audio_in is not unset else unset):
        if turn is not unset:
            s.turn_detection = turn
    return s
