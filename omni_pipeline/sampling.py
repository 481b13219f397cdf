"""A request's sampling: one typed struct from the gateway to every engine.

The gateway builds a `Sampling` from the client's request once (each front end from its own
request model); it travels on the wire as it is (StageRequest.sampling), a stage lays it over
its own defaults (the pipeline file's `sampling`, checked against these fields when the file is
read), and every engine reads it by attribute. A field left at None was not asked for: the
engine's own default applies. What an engine honours, or reads downstream of a source stage,
is a set of these fields' names, made with `params`, which refuses a name that is not one: a
misspelt field fails at import, not as a silent None at a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec


class Sampling(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """What a request asks of the engines beyond its inputs; None: not asked (the default)."""

    # Every source stage takes these (EVERY_ENGINE).
    max_tokens: int | None = None
    """The reply's budget: tokens of text, codes of audio."""
    voice: str | None = None
    """The voice to speak in (read by the stages that speak, downstream of the source too)."""
    prompt_cache_key: str | None = None
    """A conversation's name: its turns reuse the sequence a replica kept of the last."""

    # OpenAI's sampling.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (a decimal string) -> the bias added to its logit."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    """A JSON grammar: `{"type": "json_object"}` or `{"type": "json_schema", "schema": ...}`."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    # vLLM's sampling extensions (engines/sampling.py applies them as vLLM's sampler does).
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's grammar kinds (`json`, `regex`, `choice`, `grammar`), one of them."""
    # vLLM's fields for how a reply's tokens become its text.
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # vLLM's fields for how the messages become the prompt.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None

    # Images.
    n: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    previews: bool | None = None
    """A stream's: the denoiser sends a preview every few steps."""
    partial_images: int | None = None
    # Videos.
    seconds: float | None = None
    fps: int | None = None
    num_frames: int | None = None
    progress: bool | None = None
    """A job's: the denoiser reports every step."""
    # Speech.
    speed: float | None = None
    language: str | None = None
    """The language to speak (a TTS model's name for it, or Auto)."""
    instructions: str | None = None
    """How to speak: a style (a named voice's), or the voice itself described (a designed one)."""
    task_type: str | None = None
    """vLLM-Omni's TTS task: CustomVoice, VoiceDesign or Base (a cloned voice)."""
    non_streaming_mode: bool | None = None
    """Qwen3-TTS's prompt layout: the whole text in the prompt (true), or a text token beside
    each frame's codes (false); None: the model's default."""
    ref_text: str | None = None
    """A cloned voice's clip's transcript: the voice cloned in context (the clip's own codes too)."""
    x_vector_only_mode: bool | None = None
    """A cloned voice from the speaker's x-vector alone (no transcript needed)."""

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> Sampling:
        """From plain fields (a pipeline file's defaults); ValueError naming a field that is not
        one, or one of the wrong type."""
        try:
            return msgspec.convert(dict(fields), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None

    def asked(self) -> dict[str, Any]:
        """The fields set, by name."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    def over(self, under: Sampling) -> Sampling:
        """These fields, and where one is not set, `under`'s."""
        return msgspec.structs.replace(under, **self.asked())

    def only(self, names: frozenset[str]) -> Sampling:
        """Only the named fields (what a stage downstream of the source reads)."""
        return Sampling(**{k: v for k, v in self.asked().items() if k in names})


EMPTY: Final = Sampling()
FIELDS: Final = frozenset(Sampling.__struct_fields__)


def params(*names: str | Iterable[str]) -> frozenset[str]:
    """The named Sampling fields, as an engine declares what it honours or reads; ValueError
    for a name that is not one."""
    out: set[str] = set()
    for name in names:
        out.update([name] if isinstance(name, str) else name)
    if unknown := out - FIELDS:
        raise ValueError(f"not fields of Sampling: {', '.join(sorted(unknown))}")
    return frozenset(out)


EVERY_ENGINE: Final = params("max_tokens", "voice", "prompt_cache_key")
"""What every source stage takes: its budget, the voice (refused, if unknown, by the stage that
speaks), and the conversation's name (a hint: an engine that keeps no sequence computes the
same without it). Any other field the source stages must declare they honour."""
