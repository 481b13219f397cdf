"""A live session's settings, and what the served pipeline allows of them (its output
modalities, its token limit, its voices): both dialects check what a client asks by these, and
GA's `session.update` is taken here."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from omni_gateway.pipeline import Pipeline
from omni_gateway.realtime.protocol import RealtimeError, ServerVad, SessionConfig
from omni_pipeline.spec import OutputKind


@dataclass
class Settings:
    """The session's settings, as `session.update` leaves them."""

    output_modalities: list[str]
    instructions: str = ""
    max_output_tokens: int | None = None
    """None: "inf" (up to the gateway's own limit)."""
    voice: str | None = None
    """None: the model's own default."""
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    """Server VAD unless the client turns it off (null: it commits each turn), as OpenAI's."""
    temperature: float | None = None
    """None: the model's own (the duplex dialect's `session.temperature` sets it; GA has none)."""

    def copy(self) -> Settings:
        return Settings(**vars(self))


class SettingsRules:
    """What the served pipeline allows a session: each check returns the value to set, or
    raises a RealtimeError naming `param`."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.speaks = OutputKind.AUDIO in pipeline.spec.output_kinds()

    def defaults(self) -> Settings:
        return Settings(output_modalities=["audio"] if self.speaks else ["text"])

    def model(self, asked: str, param: str) -> None:
        if asked != self.pipeline.spec.served_model_name:
            raise RealtimeError(f"{param}: model '{asked}' is not served here", param=param)

    def modalities(self, asked: list[str], param: str) -> list[str]:
        if sorted(set(asked)) not in (["audio"], ["text"]):
            raise RealtimeError(f"{param}: ['audio'] (speech and its transcript) or ['text']", param=param)
        if asked == ["audio"] and not self.speaks:
            raise RealtimeError(
                f"{param}: model '{self.pipeline.spec.served_model_name}' does not speak", param=param
            )
        return list(asked)

    def max_tokens(self, asked: int | str, param: str) -> int | None:
        if asked == "inf":
            return None
        limit = self.pipeline.spec.gateway.max_tokens
        if not isinstance(asked, int) or not 1 <= asked <= limit:
            raise RealtimeError(f"{param}: 1 to {limit}, or 'inf'", param=param)
        return asked

    def voice(self, voice: str | None, param: str) -> str | None:
        voices = self.pipeline.voices()
        if voice is not None and voices is not None and voice not in voices:
            listed = ", ".join(sorted(voices)) or "none (this model's speech takes no voice)"
            raise RealtimeError(
                f"{param}: voice '{voice}' is not one of this model's voices: {listed}", param=param
            )
        return voice


def updated(settings: Settings, config: SessionConfig, rules: SettingsRules) -> Settings:
    """GA's `session.update` over `settings`: every field checked first, then set, so an update
    is taken whole or not at all."""
    s = settings.copy()
    if config.model is not msgspec.UNSET:
        rules.model(config.model, "session.model")
    if config.output_modalities is not msgspec.UNSET:
        s.output_modalities = rules.modalities(config.output_modalities, "session.output_modalities")
    if config.instructions is not msgspec.UNSET:
        s.instructions = config.instructions
    if config.max_output_tokens is not msgspec.UNSET:
        s.max_output_tokens = rules.max_tokens(config.max_output_tokens, "session.max_output_tokens")
    audio = config.audio
    turn = audio.input.turn_detection if audio and audio.input else msgspec.UNSET
    if turn is not msgspec.UNSET:
        s.turn_detection = turn
    if audio is not msgspec.UNSET and audio.output is not msgspec.UNSET:
        out = audio.output
        if out.speed is not msgspec.UNSET and out.speed != 1.0:
            raise RealtimeError(
                "session.audio.output.speed: only 1.0 is served", param="session.audio.output.speed"
            )
        if out.voice is not msgspec.UNSET:
            s.voice = rules.voice(out.voice, "session.audio.output.voice")
    return s
