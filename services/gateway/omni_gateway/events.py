"""What a request yields to the routes that answer it: the outputs of its final stages, as
they come, then how it finished."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omni_pipeline.control import PromptLogprobs, TokenLogprob, ToolCall


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """For the tokens behind the text, when the request asked for them."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The calls the reply ends with, when the request offered tools."""
    usage: dict[str, int] | None = None
    """The text stage's `prompt_tokens` and `completion_tokens` so far, this delta's included
    (vLLM's continuous usage stats)."""


@dataclass(frozen=True, slots=True)
class AudioChunk:
    samples: np.ndarray
    sample_rate: int


@dataclass(frozen=True, slots=True)
class ImageProgress:
    """Seed 000's ImageProgressEvent: a preview after `step` steps, or the final images
    (`is_last`); one RGB array [height, width, 3] uint8 per image of the request."""

    step: int
    images: list[np.ndarray]
    is_last: bool


@dataclass(frozen=True, slots=True)
class VideoProgress:
    """A video request after `step` of its `steps` denoising steps; the last one (`is_last`)
    carries the clips, one RGB array [frames, height, width, 3] uint8 per video, made to be
    played at `fps`."""

    step: int
    steps: int
    videos: list[np.ndarray]
    fps: int
    is_last: bool


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One stage's part in a request, as the gateway saw it: what it read and made (its units:
    tokens, codes, samples), and when, from the attempt's start, its first output reached the
    gateway (final stages) and its last message did."""

    index: int
    """Its place in the pipeline's stages."""
    final_output: str | None
    units_in: int
    units_out: int
    first_output_ms: float | None
    done_ms: float


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    usage: dict[str, int]
    """The text stage's: `prompt_tokens`, `completion_tokens`, `total_tokens` (chat's usage)."""
    prompt_tokens: int = 0
    """What every stage on the route read of the client's request (the source stages count it)."""
    fed_units: int = 0
    """What the stages feeding the final audio or image stages made for them (a talker's codec
    codes): a speech response's output tokens."""
    stages: dict[str, StageFigures] = field(default_factory=dict)
    """Each stage on the route, by name (vLLM-Omni's `return_stage_metrics`)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The text stage's, where the request asked (vLLM's `prompt_logprobs`)."""


Event = TextDelta | AudioChunk | ImageProgress | VideoProgress | Finished


@dataclass(frozen=True, slots=True)
class OfChoice:
    """An event of reply `index` of a chat request asking for several (`n`)."""

    index: int
    event: Event
