"""A full-duplex session, in vLLM-Omni's dialect: a Realtime session that outlives its socket.

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

from omni_gateway.audio import PcmResampler
from omni_gateway.metrics import GatewayMetrics
from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.conversation import Part, decode_pcm, pcm_ms, truncate
from omni_gateway.realtime.duplex_protocol import (
    CAPABILITIES,
    DEFAULT_INPUT_RATE,
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
    PlaybackPolicy,
    SessionClose,
    SessionResume,
    TextAppend,
)
from omni_gateway.realtime.link import Attachment, Hello, Link
from omni_gateway.realtime.protocol import (
    PCM_RATE,
    AudioClear,
    RealtimeError,
    ResponseParams,
    new_id,
    parse_event,
)
from omni_gateway.realtime.response import Response
from omni_gateway.realtime.session import RealtimeSession, Settings

_OUTPUT_DELTAS: Final = frozenset(
    {
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_text.delta",
    }
)


MAX_TYPED: Final = 65536
"""Characters typed into one user turn (input.text.append) before its commit."""


class DuplexSession(RealtimeSession):
    """A live session of the duplex dialect; LiveSessions holds it while its socket is away."""

    def __init__(
        self,
        pipeline: Pipeline,
        max_buffer_bytes: int,
        metrics: GatewayMetrics,
        journal_bytes: int,
        max_idle_s: float,
    ) -> None:
        super().__init__(pipeline, self._deliver, max_buffer_bytes, metrics)
        self.link = Link(self.id, journal_bytes)
        self.settings.turn_detection = None  # the dialect's default: the client commits
        self.started = time.monotonic()
        self.max_idle_s = max_idle_s
        self.idle_timeout_s: float | None = None
        """The client's own idle limit (at most the gateway's); None: the gateway's."""
        self.auto_response = True
        self.overlap_policy: OverlapPolicy | None = None
        """None: VAD's own `interrupt_response` decides."""
        self.playback_policy: PlaybackPolicy = "commit_all_on_done"
        self.input_rate = DEFAULT_INPUT_RATE
        self._resampler = PcmResampler(DEFAULT_INPUT_RATE, PCM_RATE)
        self._typed: list[str] = []
        """Text the client typed into the user's turn (input.text.append), until its commit."""
        self._spoke = False
        """Whether any audio appended since the last commit was not marked `is_speech: false`."""
        self._last: Response | None = None
        """The latest response: the one playback acks are about."""
        self._played_ms: int | None = None
        """What the client last said it played of the latest response (None: nothing said)."""
        self._spoken: str | None = None
        """The response whose speak decision went out."""

    # --- the socket's side -------------------------------------------------------------------

    @property
    def idle_s(self) -> float:
        return self.idle_timeout_s or self.max_idle_s

    async def start(self, socket: Attachment) -> None:
        """On its first socket: session.created, with the token to resume it."""
        await self._detect_turns()
        await self.link.attach(socket, self._hello("session.created"))

    async def resume(self, socket: Attachment, token: str, last_seq: int) -> Attachment | None:
        """Onto `socket` (Link.resume): session.resumed, then what the client missed."""
        return await self.link.resume(socket, token, last_seq, self._hello("session.resumed"))

    @property
    def resumable(self) -> bool:
        return not self.link.journal.overflowed and self.ended is None

    async def finish(self, reason: str) -> None:
        """The session ends: its answer in progress first (cancelled, said), then
        session.closed says why, its last event; the socket's handler closes the socket."""
        if self.ended is None:
            self.ended = reason
            await self.cancel("client_cancelled")
            await self.emit("session.closed", session_id=self.id, reason=reason, event={})

    def parse(self, data: str | bytes) -> Any:
        return parse_event(data, DUPLEX_DECODER)

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
        await self.link.deliver(event)

    async def emit(self, type_: str, **fields: Any) -> None:
        """The dialect's additions to GA's events: a response's id at the top of its created
        and done, the speak decision before its first output, each audio delta's format."""
        if type_ in ("response.created", "response.done"):
            fields["response_id"] = fields["response"]["id"]
        elif type_ in _OUTPUT_DELTAS and fields["response_id"] != self._spoken:
            self._spoken = fields["response_id"]
            await super().emit(
                "response.speak",
                response_id=self._spoken,
                item_id=fields["item_id"],
                metadata={"implementation_level": CAPABILITIES["implementation_level"]},
            )
        if type_ == "response.output_audio.delta":
            fields.update(format=PCM16, sample_rate_hz=OUTPUT_RATE)
        await super().emit(type_, **fields)

    def session_wire(self) -> dict[str, Any]:
        wire = super().session_wire()
        s = self.settings
        audio_in, audio_out = wire["audio"]["input"], wire["audio"]["output"]
        audio_in.update(format={"type": "audio/pcm", "rate": self.input_rate}, sample_rate_hz=self.input_rate)
        audio_out["sample_rate_hz"] = OUTPUT_RATE
        wire.update(
            session_id=self.id,
            modalities=["audio", "text"] if "audio" in s.output_modalities else ["text"],
            input_audio_format=PCM16,
            output_audio_format=PCM16,
            sample_rate_hz=self.input_rate,
            turn_detection=audio_in["turn_detection"],
            voice=s.voice,
            temperature=s.temperature,
            idle_timeout_s=self.idle_s,
            overlap_policy=self.overlap_policy,
            playback_commit_policy=self.playback_policy,
            extra_body={"auto_response": self.auto_response},
            capabilities=CAPABILITIES,
        )
        return wire

    # --- client events -----------------------------------------------------------------------

    async def _handle(self, event: Any) -> None:
        match event:
            case DuplexSessionUpdate(session=config):
                before = self.settings.turn_detection
                await self.configure(config)
                if self.settings.turn_detection != before:
                    await self._detect_turns()
                await self.emit("session.updated", session=self.session_wire())
            case DuplexAppend():
                await self._append(event)
            case DuplexCommit():
                await self._commit(event)
            case AudioClear() | InputCancel():
                await self._clear_input()
                await self.emit("input_audio_buffer.cleared")
            case TextAppend(text=text):
                if sum(map(len, self._typed)) + len(text) > MAX_TYPED:
                    raise RealtimeError(
                        f"text: a turn holds {MAX_TYPED} typed characters at most; commit it",
                        code="input_text_too_long",
                        param="text",
                    )
                self._typed.append(text)
            case PlaybackAck():
                await self._playback(event)
            case BargeIn():
                await self._barge_in()
            case EventAck(server_event_seq=seq):
                try:
                    self.link.journal.acknowledge(seq)
                except ValueError as exc:
                    raise RealtimeError(
                        str(exc), code="invalid_event_ack", param="server_event_seq"
                    ) from None
            case Heartbeat():
                await self.emit("session.heartbeat_ack", session_id=self.id)
            case SessionClose(reason=reason):
                await self.finish(reason)
            case SessionResume():
                raise RealtimeError(
                    "session.resume is a new connection's first message",
                    code="unsupported_session_resume",
                )
            case _:
                await super()._handle(event)

    async def configure(self, c: DuplexSessionConfig) -> None:
        """Check every field first, then set them: an update is taken whole or not at all."""
        unset = msgspec.UNSET
        s = Settings(**vars(self.settings))
        if c.model is not unset and c.model != self.pipeline.spec.served_model_name:
            raise RealtimeError(f"session.model: model '{c.model}' is not served here", param="session.model")
        for name in ("output_modalities", "modalities"):
            if (asked := getattr(c, name)) is not unset:
                speech = ["audio"] if "audio" in asked else ["text"]  # audio is spoken with its transcript
                s.output_modalities = self._modalities(speech, f"session.{name}")
                break
        if c.instructions is not unset:
            s.instructions = c.instructions
        if c.temperature is not unset:
            s.temperature = c.temperature
        for name in ("max_output_tokens", "max_response_output_tokens"):
            if (asked := getattr(c, name)) is not unset:
                s.max_output_tokens = self._max_tokens(asked, f"session.{name}")
        audio_in = c.audio.input if c.audio is not unset else unset
        audio_out = c.audio.output if c.audio is not unset else unset
        voices = [(c.voice, "session.voice")]
        if audio_out is not unset:
            voices.append((audio_out.voice, "session.audio.output.voice"))
        for voice, param in voices:
            if voice is not unset:
                s.voice = self._voice(voice, param)
        turns = [c.turn_detection, audio_in.turn_detection if audio_in is not unset else unset]
        for turn in turns:
            if turn is not unset:
                s.turn_detection = turn
        rate = self.input_rate
        rates = [(c.sample_rate_hz, "session.sample_rate_hz")]
        if audio_in is not unset:
            rates.append((audio_in.sample_rate_hz, "session.audio.input.sample_rate_hz"))
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
        playback = self.playback_policy if c.playback_commit_policy is unset else c.playback_commit_policy
        if rate != self.input_rate:
            await self._flush_input()
            self._resampler = PcmResampler(rate, PCM_RATE)
        self.settings, self.input_rate, self.idle_timeout_s = s, rate, idle
        self.auto_response, self.overlap_policy, self.playback_policy = auto, overlap, playback

    async def _append(self, event: DuplexAppend) -> None:
        if event.sample_rate_hz is not None and event.sample_rate_hz != self.input_rate:
            raise RealtimeError(
                f"sample_rate_hz: the session's input is {self.input_rate} Hz (session.update sets it)",
                param="sample_rate_hz",
            )
        pcm = decode_pcm(event.audio, "audio")
        if event.duration_ms is not None and abs(event.duration_ms - len(pcm) * 500 / self.input_rate) > 1:
            raise RealtimeError(
                f"duration_ms: {event.duration_ms} is not the audio's length at {self.input_rate} Hz",
                param="duration_ms",
            )
        speech = event.is_speech is not False
        self._spoke = self._spoke or speech
        await self.append(self._resampler.feed(pcm), speech)

    async def _flush_input(self) -> None:
        """The resampler's last samples into the buffer: the user's turn is whole."""
        if tail := self._resampler.flush():
            await self.append(tail)

    async def _clear_input(self) -> None:
        self._resampler.reset()
        self._typed.clear()
        self._spoke = False
        self.buffer.clear()

    async def _commit(self, c: DuplexCommit) -> None:
        """A final commit ends the user's turn, and is answered unless the client says not
        (`response_create`) or turned `auto_response` off; any other is the decision to listen.
        Audio the client marked as not speech (only such audio, or the commit's `is_speech:
        false`) makes no item: it is dropped, and the session listens on."""
        await self._flush_input()
        if self.buffer.size and not self._typed and (c.is_speech is False or not self._spoke):
            await self._clear_input()
            await self._listen(c.final, "not_speech")
            return
        await self.commit()
        self._spoke = False
        if c.response_create if c.response_create is not None else c.final and self.auto_response:
            await self.create_response(ResponseParams())
            return
        await self._listen(c.final, "commit")

    async def _listen(self, final: bool, reason: str) -> None:
        listening = {
            "object": "realtime.response",
            "status": "listening",
            "metadata": {"final": final, "reason": reason},
        }
        await self.emit("response.listen", session_id=self.id, response=listening)

    def _user_parts(self, until_ms: int | None) -> list[Part]:
        """What the client typed into the turn, then what it said."""
        parts = [Part("input_text", text="".join(self._typed))] if self._typed else []
        if self.buffer.size:
            parts.append(Part("input_audio", pcm=self.buffer.take(until_ms)))
        if not parts:
            raise RealtimeError(
                "nothing to commit: append audio (or input.text.append) first",
                code="input_audio_buffer_commit_empty",
            )
        self._typed.clear()
        return parts

    async def create_response(self, params: ResponseParams) -> None:
        if self.playback_policy == "ack_only" and self.responses.active is None:
            # The answer before keeps what was played of it.
            await self._keep_what_was_played()
        await super().create_response(params)
        self._last, self._played_ms = self.responses.active, None

    async def _playback(self, ack: PlaybackAck) -> None:
        r = self._last
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
        self._played_ms = max(self._played_ms or 0, committed)
        cursor = {
            "response_id": r.id,
            "item_id": r.item.id,
            "played_ms": played,
            "committed_ms": self._played_ms,
            "sent_ms": sent,
        }
        await self.emit("playback.acknowledged", event=cursor)

    async def _barge_in(self) -> None:
        """The user cut in: the answer in progress ends, and what was not played of the latest
        answer leaves the conversation."""
        cut = self.responses.active is not None
        await self.cancel("turn_detected")
        cut = await self._keep_what_was_played() or cut
        if cut:
            self.metrics.barge_ins.inc()

    async def _speech_started(self, at_ms: int) -> None:
        await super()._speech_started(at_ms)
        assert self.detector is not None
        if self.detector.settings.interrupt_response:
            await self._keep_what_was_played()

    async def _keep_what_was_played(self) -> bool:
        """Cut the latest answer's item to what the client said it played (as its own
        conversation.item.truncate would); True if there was more. Without a playback ack it
        keeps what was sent."""
        r, played = self._last, self._played_ms
        if played is None and self.playback_policy == "ack_only":
            played = 0  # nothing acknowledged: nothing heard
        if r is None or played is None or not r.speaks or played >= pcm_ms(r.part.audio_bytes):
            return False
        truncate(r.item, 0, played)
        await self.emit(
            "conversation.item.truncated", item_id=r.item.id, content_index=0, audio_end_ms=played
        )
        return True
