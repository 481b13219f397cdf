"""A request as the pipeline API takes it: as a front end hands it over (`PipelineRequest`), and
past every pre-flight check, as each attempt sends it (`Prepared`)."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Final

import torch

from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind
from omni_pipeline.voices import VoicePrint


@dataclass(frozen=True)
class PipelineRequest:
    """A request as a front end hands it over, before any check."""

    model: str | None
    outputs: frozenset[OutputKind]
    inputs: RequestInputs
    sampling: Sampling
    outputs_param: str = "model"
    """The client's field that asked for the outputs (a 400 names it)."""
    voice_param: str | None = None
    """The client's field the voice came in (`sampling.voice`), to name in a 400."""
    max_tokens_param: str = "max_tokens"
    declared: frozenset[str] | None = None
    """The sampling fields every source stage takes; any other must be one the source stages
    declare they honour. None: the endpoint's fields are for stages downstream to take."""
    per_stage: dict[str, Sampling] = field(default_factory=dict)
    """Sampling asked of one stage alone (vLLM-Omni's `sampling_params_list`), by stage: each
    field one the stage declares it honours."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Media decoded by the front end (an edit's images), by the keys `inputs` refers to them
    with; a chat's come inside its messages and are decoded by `Pipeline.prepare`."""
    ref_audio: str | None = None
    """A voice to clone's clip as the client sent it (a data: URL, base64, an http(s) URL):
    decoded by `Pipeline.prepare` into `media`, `inputs.ref_audio` referring to it."""
    voice_print: VoicePrint | None = None
    """An uploaded voice's print, in place of a clip: put into `media` by `Pipeline.prepare`."""
    priority: int = 0
    """vLLM's `priority`: a replica starts its waiting requests the lower value first."""


@dataclass(frozen=True)
class Prepared:
    """A request past every pre-flight check, as each attempt sends it."""

    inputs: RequestInputs
    sampling: Sampling
    outputs: frozenset[OutputKind]
    media: dict[str, torch.Tensor]
    """Decoded media, by the keys the messages refer to them with."""
    per_stage: dict[str, Sampling] = field(default_factory=dict)
    """Sampling the client asked of one stage alone, by stage (StageRequest.own)."""
    priority: int = 0


BATCH_PRIORITY: Final[ContextVar[int]] = ContextVar("omni_batch_priority", default=0)
"""Added to the priority of every request made in this context: the batch runner's lines run
with it set (omni_gateway.batches.runner), so replicas start them after live users' requests."""

ON_ROUTED: Final[ContextVar[Callable[[], None] | None]] = ContextVar("omni_on_routed", default=None)
"""Called once a request made in this context has its replicas (an attempt has picked them; may
be called again): the batch runner counts its lines that have none yet against the replicas'
free slots."""
