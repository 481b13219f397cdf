"""Pre-flight checks: what a request must pass before anything runs, each a pure function of the
request and what the replicas announced in their heartbeats (`Announced`), raising the 400 (or
404) that names the client's field at fault. A check whose announcements have not all arrived
passes: the stage refuses what it cannot do itself then.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from omni_gateway.errors import BadRequest, ModelNotFound
from omni_gateway.replicas import ReplicaTable
from omni_gateway.request import PipelineRequest
from omni_pipeline import wire
from omni_pipeline.clips import ClipError, check_size, clip_frames
from omni_pipeline.spec import REQUEST_SOURCE, OutputKind, PipelineSpec

PER_STAGE_ALWAYS = frozenset({"max_tokens", "top_logprobs"})
"""What a stage's own sampling may set whatever its engine declares (`logprobs` comes with it)."""


@dataclass(frozen=True)
class Announced:
    """The pipeline as the checks see it: its stages, and what their replicas announced."""

    spec: PipelineSpec
    table: ReplicaTable

    @cached_property
    def reading(self) -> frozenset[str]:
        """The stages that read the client's request."""
        return frozenset(s.name for s, _ in self.spec.consumers(REQUEST_SOURCE))

    def sources(self, outputs: Iterable[OutputKind]) -> list[str]:
        """The stages on these outputs' route that read the client's request and decide what it
        may ask (an encoder that runs only on media does not: the same field must not be
        honoured or refused by whether media came along)."""
        needed = self.spec.needed_stages(set(outputs))
        return [s for s in needed if s in self.reading and not self.spec.stage(s).skip_without_media]

    def by_sources(
        self, outputs: Iterable[OutputKind], what: Literal["accepts", "honours"]
    ) -> frozenset[str] | None:
        """What every source stage on these outputs' route declares it reads (`accepts`: content
        part kinds) or honours (sampling fields); None while one of them has not declared."""
        if what == "honours":
            stages = self.sources(outputs)
        else:
            stages = [s for s in self.spec.needed_stages(set(outputs)) if s in self.reading]
        declared: frozenset[str] | None = None
        for stage in stages:
            if (own := self.table.declared(stage, what)) is None:
                return None
            declared = own if declared is None else declared & own
        return declared

    def clones(self, outputs: Iterable[OutputKind]) -> bool | None:
        """Whether these outputs' source stages clone voices (they read a `ref_audio` clip: a
        Qwen3-TTS Base model's talker); None while one has not declared what it reads."""
        accepts = self.by_sources(outputs, "accepts")
        return None if accepts is None else "ref_audio" in accepts

    def voices(self) -> frozenset[str] | None:
        """The voices this pipeline speaks in: those every stage on the audio route that takes
        a voice speaks in (none: it takes no voice); None while one has not declared its own."""
        spoken: frozenset[str] | None = None
        for stage in self.spec.needed_stages({OutputKind.AUDIO}):
            if (own := self.table.declared(stage, "voices")) is None:
                return None
            if own:
                spoken = own if spoken is None else spoken & own
        return spoken or frozenset()

    def engine_kinds(self, stages: Iterable[str]) -> str:
        return ", ".join(sorted({self.spec.stage(s).engine.kind for s in stages}))


def check_request(a: Announced, req: PipelineRequest) -> None:
    """Every check of a request's own fields, in the order a client would fix them."""
    check_model(a, req.model, req.outputs, req.outputs_param)
    check_max_tokens(a, req)
    check_honoured(a, req)
    check_per_stage(a, req)
    check_travels(req)
    check_voice(a, req)
    check_language(a, req)
    if req.inputs.images:
        check_editing(a, req.outputs)
    if req.ref_audio is not None or req.voice_print is not None:
        check_cloning(a, req.outputs)


def check_model(a: Announced, model: str | None, wanted: frozenset[OutputKind], param: str) -> None:
    """404 for another model's name; 400 for an output this pipeline does not make."""
    name = a.spec.served_model_name
    if model is not None and model != name:
        raise ModelNotFound(f"model '{model}' does not exist", param="model")
    offered = a.spec.output_kinds()
    if missing := wanted - offered:
        raise BadRequest(
            f"model '{name}' cannot output {', '.join(sorted(m.value for m in missing))}; "
            f"it outputs {', '.join(sorted(k.value for k in offered))}",
            param=param,
        )


def check_max_tokens(a: Announced, req: PipelineRequest) -> None:
    limit = a.spec.gateway.max_tokens
    if (asked := req.sampling.max_tokens) is not None and asked > limit:
        param = req.max_tokens_param
        raise BadRequest(f"{param}: {asked} is more than this model's limit of {limit}", param=param)


def check_honoured(a: Announced, req: PipelineRequest) -> None:
    """A 400 naming the first sampling field (beyond those every engine takes) that a source
    stage on the request's route does not declare it honours."""
    if req.declared is None or (honoured := a.by_sources(req.outputs, "honours")) is None:
        return
    for name in sorted(req.sampling.asked().keys() - req.declared - honoured):
        stages = [s for s in a.sources(req.outputs) if name not in (a.table.declared(s, "honours") or ())]
        where = f"stage {', '.join(repr(s) for s in stages)} ({a.engine_kinds(stages)})"
        raise BadRequest(f"{name}: not honoured by {where}; leave it out", param=name)


def check_per_stage(a: Announced, req: PipelineRequest) -> None:
    """A 400 for sampling asked of a stage this request does not run, or that the stage does not
    declare it honours."""
    order = [s.name for s in a.spec.stages]
    needed = a.spec.needed_stages(set(req.outputs))
    for stage, own in req.per_stage.items():
        param = f"sampling_params_list.{order.index(stage)}"
        if stage not in needed:
            raise BadRequest(f"{param}: stage '{stage}' does not run for this request's outputs", param=param)
        if (honoured := a.table.declared(stage, "honours")) is None:
            continue
        for name in sorted(own.asked().keys() - PER_STAGE_ALWAYS - honoured):
            raise BadRequest(
                f"{param}.{name}: not honoured by stage '{stage}' ({a.engine_kinds([stage])}); leave it out",
                param=f"{param}.{name}",
            )


def check_travels(req: PipelineRequest) -> None:
    """What the stages get must travel (a number past 64 bits, in a template's variables)."""
    try:
        wire.encode([req.sampling, req.per_stage])
    except wire.WireError as exc:
        raise BadRequest(f"the request's parameters cannot be sent on: {exc}") from None


def check_voice(a: Announced, req: PipelineRequest) -> None:
    """A 400 listing the voices, for a voice this pipeline does not speak in."""
    voice, param = req.sampling.voice, req.voice_param
    if OutputKind.AUDIO not in req.outputs or param is None or voice is None:
        return
    if (voices := a.voices()) is None:
        return
    if not voices:
        if a.clones(req.outputs):  # it speaks in uploaded voices alone
            raise BadRequest(
                f"{param}: '{voice}' is no voice uploaded to this model (GET /v1/audio/voices lists them)",
                param=param,
            )
        raise BadRequest(f"{param}: this model's audio takes no voice; leave it out", param=param)
    if voice not in voices:
        raise BadRequest(
            f"{param}: voice '{voice}' is not one of this model's voices: {', '.join(sorted(voices))}",
            param=param,
        )


def check_language(a: Announced, req: PipelineRequest) -> None:
    """A 400 listing the languages, for one the stages that speak do not (case aside, as the
    models read them); what takes no language refuses the field as not honoured."""
    if (language := req.sampling.language) is None:
        return
    for stage in a.sources(req.outputs):
        spoken = a.table.declared(stage, "languages")
        if spoken and language.lower() not in {s.lower() for s in spoken}:
            raise BadRequest(
                f"language: '{language}' is not one of this model's languages: {', '.join(sorted(spoken))}",
                param="language",
            )


def check_editing(a: Announced, outputs: frozenset[OutputKind]) -> None:
    """A 400 naming `image` for a pipeline whose source stages read no image (one that makes
    images from a prompt alone)."""
    accepts = a.by_sources(outputs, "accepts")
    if accepts is not None and "image" not in accepts:
        raise BadRequest(
            f"image: model '{a.spec.served_model_name}' does not edit images; "
            f"it makes them from a prompt alone",
            param="image",
        )


def check_cloning(a: Announced, outputs: frozenset[OutputKind]) -> None:
    """A 400 naming `ref_audio` for a pipeline whose source stages clone no voice (they declare
    they read a `ref_audio` clip: a Qwen3-TTS Base model's talker)."""
    if a.clones(outputs) is False:
        raise BadRequest(
            f"ref_audio: model '{a.spec.served_model_name}' clones no voice (Base models do); leave it out",
            param="ref_audio",
        )


def check_clip(
    a: Announced,
    width: int | None,
    height: int | None,
    seconds: float | None,
    fps: int | None,
    num_frames: int | None,
) -> None:
    """A 400 naming the field, for a video the stages that make it have said they cannot
    (omni_pipeline.clips)."""
    for stage in a.spec.needed_stages({OutputKind.VIDEO}):
        if (limits := a.table.clip_limits(stage)) is None:
            continue
        try:
            if width is not None or height is not None:
                check_size(
                    width or limits.multiple, height or limits.multiple, limits.multiple, limits.max_size
                )
            clip_frames(limits, seconds, fps, num_frames)
        except ClipError as exc:
            raise BadRequest(str(exc), param=exc.param) from None
