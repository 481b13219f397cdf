"""The gateway's pre-flight checks (omni_gateway.preflight), each driven alone against a replica
table that heartbeats fill, without NATS or a Pipeline: a check passes while what it reads has
not been announced, and refuses with a 400 naming the client's own field once it has."""

from __future__ import annotations

import time

import pytest

from omni_gateway.errors import BadRequest
from omni_gateway.preflight import (
    Announced,
    check_clip,
    check_cloning,
    check_honoured,
    check_language,
    check_per_stage,
    check_voice,
)
from omni_gateway.replicas import ReplicaTable
from omni_gateway.request import PipelineRequest
from omni_pipeline.clips import ClipLimits
from omni_pipeline.control import Heartbeat, RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind, load_pipeline
from tests.helpers import ROOT

TEXT = frozenset({OutputKind.TEXT})
AUDIO = frozenset({OutputKind.TEXT, OutputKind.AUDIO})


@pytest.fixture
def announced() -> Announced:
    return Announced(load_pipeline(ROOT / "tests" / "data" / "synthetic.yaml").spec, ReplicaTable("inbox"))


def announce(a: Announced, stage: str, **declared: object) -> None:
    """A replica's heartbeat, as the bus hands it to the table."""
    hb = Heartbeat(stage, "0", f"{stage}-i", 1, "host", 0, 0, 4, 4, False, 1.0, **declared)  # type: ignore[arg-type]
    a.table.update(hb, time.monotonic())


def request(sampling: Sampling, outputs: frozenset[OutputKind] = TEXT, **fields: object) -> PipelineRequest:
    return PipelineRequest(
        "synth",
        outputs,
        RequestInputs(["text"]),
        sampling,
        voice_param="audio.voice",
        declared=frozenset({"max_tokens", "voice"}),
        **fields,  # type: ignore[arg-type]
    )


def test_a_field_the_source_does_not_honour_is_refused_naming_it_and_the_stage(announced: Announced) -> None:
    asked = request(Sampling(max_tokens=4, top_k=5, temperature=0.5))
    check_honoured(announced, asked)  # nothing announced yet: the stage refuses it itself
    announce(announced, "thinker", honours=["temperature"])
    with pytest.raises(BadRequest) as exc:
        check_honoured(announced, asked)
    assert exc.value.param == "top_k"
    assert exc.value.message == "top_k: not honoured by stage 'thinker' (synthetic); leave it out"
    check_honoured(announced, request(Sampling(max_tokens=4, voice="alloy", temperature=0.5)))


def test_a_stages_own_sampling_is_checked_against_that_stage(announced: Announced) -> None:
    own = request(Sampling(max_tokens=4), AUDIO, per_stage={"talker": Sampling(max_tokens=9, seed=1)})
    check_per_stage(announced, own)
    announce(announced, "talker", honours=[])
    with pytest.raises(BadRequest) as exc:
        check_per_stage(announced, own)
    assert exc.value.param == "sampling_params_list.1.seed"
    text_only = request(Sampling(max_tokens=4), TEXT, per_stage={"vocoder": Sampling(max_tokens=1)})
    with pytest.raises(BadRequest, match="stage 'vocoder' does not run for this request's outputs"):
        check_per_stage(announced, text_only)


def test_a_voice_no_stage_speaks_in_is_refused_listing_the_voices(announced: Announced) -> None:
    nova = request(Sampling(voice="nova"), AUDIO)
    for stage in ("thinker", "talker"):
        announce(announced, stage, voices=[])
    check_voice(announced, nova)  # the vocoder has not said yet
    announce(announced, "vocoder", voices=["alloy", "echo"])
    with pytest.raises(BadRequest) as exc:
        check_voice(announced, nova)
    assert exc.value.param == "audio.voice" and exc.value.message.endswith("voices: alloy, echo")
    check_voice(announced, request(Sampling(voice="nova"), TEXT))  # no audio asked: no voice read


def test_a_language_the_source_does_not_speak_is_refused_listing_them(announced: Announced) -> None:
    klingon = request(Sampling(language="Klingon"), AUDIO)
    check_language(announced, klingon)  # nothing announced: the stage refuses it itself
    announce(announced, "thinker", languages=["Auto", "English", "Chinese"])
    with pytest.raises(BadRequest) as exc:
        check_language(announced, klingon)
    assert exc.value.param == "language"
    assert (
        exc.value.message
        == "language: 'Klingon' is not one of this model's languages: Auto, Chinese, English"
    )
    check_language(announced, request(Sampling(language="english"), AUDIO))  # case aside, as models read it
    check_language(announced, request(Sampling(), AUDIO))


def test_a_clip_beyond_what_the_video_stage_announced_names_the_field() -> None:
    video = load_pipeline(ROOT / "examples" / "tiny-video.yaml").spec
    a = Announced(video, ReplicaTable("inbox"))
    (stage,) = [s.name for s in video.stages if s.final_output is OutputKind.VIDEO]
    check_clip(a, 40, None, 100.0, None, None)  # nothing announced
    announce(a, stage, clip_limits=ClipLimits(16, 64, 8, 17, 33, 4))
    with pytest.raises(BadRequest) as exc:
        check_clip(a, 40, None, None, None, None)
    assert exc.value.param == "size"
    with pytest.raises(BadRequest) as exc:
        check_clip(a, None, None, 100.0, None, None)
    assert exc.value.param == "seconds"
    check_clip(a, 32, 32, 1.0, None, None)


def test_a_clip_to_clone_is_refused_where_no_source_stage_reads_one(announced: Announced) -> None:
    check_cloning(announced, AUDIO)  # nothing announced yet: the stage refuses it itself
    announce(announced, "thinker", accepts=["text", "audio"])
    with pytest.raises(BadRequest) as exc:
        check_cloning(announced, AUDIO)
    assert exc.value.param == "ref_audio"
    assert exc.value.message == "ref_audio: model 'synth' clones no voice (Base models do); leave it out"
    announce(announced, "thinker", accepts=["text", "ref_audio"])
    check_cloning(announced, AUDIO)
