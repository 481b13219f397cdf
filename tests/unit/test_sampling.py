"""A request's sampling as one typed struct (omni_pipeline.sampling): what the gateway builds is
what every engine reads, a misspelt field is an error where it is written, and a stage lays a
request's fields over its pipeline file's defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_pipeline import wire
from omni_pipeline.control import RequestContext, StageRequest, pack, unpack
from omni_pipeline.sampling import EMPTY, EVERY_ENGINE, FIELDS, Sampling, params
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import Engine, import_object
from omni_stage.engines.registry import FAMILIES, GENERIC
from omni_stage.engines.sampling import HONOURED


def test_it_travels_as_it_is_and_only_the_fields_asked_go_on_the_wire() -> None:
    asked = Sampling(max_tokens=5, temperature=0.5, stop=["\n"], logit_bias={"7": -1.0})
    ctx = RequestContext("r", {"thinker": "0"}, "inbox", 0.0)
    back = unpack(pack(StageRequest(ctx, None, asked)), StageRequest)
    assert back.sampling == asked and back.own == EMPTY
    plain = wire.decode(wire.encode(asked))  # what a reader that knows no struct sees
    assert plain == {"max_tokens": 5, "temperature": 0.5, "stop": ["\n"], "logit_bias": {"7": -1.0}}


def test_a_field_that_is_not_one_or_of_the_wrong_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="temprature"):
        Sampling.of({"temprature": 0.5})
    with pytest.raises(ValueError, match="max_tokens"):
        Sampling.of({"max_tokens": "many"})
    assert Sampling.of({"temperature": 1}).temperature == 1.0  # an int where a float goes, as JSON has it
    with pytest.raises(ValueError, match="not fields of Sampling: temprature"):
        params("temperature", "temprature")


def test_a_pipeline_files_misspelt_default_fails_when_the_file_is_read() -> None:
    stage = {"name": "thinker", "engine": {"kind": "synthetic"}, "inputs": [{"from": "request"}]}
    StageSpec.model_validate({**stage, "sampling": {"max_tokens": 8}})
    with pytest.raises(ValidationError, match="max_token"):
        StageSpec.model_validate({**stage, "sampling": {"max_token": 8}})


def test_a_request_lays_its_fields_over_the_defaults_and_a_stage_downstream_takes_only_its_own() -> None:
    defaults = Sampling(max_tokens=48, temperature=0.9)
    asked = Sampling(max_tokens=5, voice="Ethan", seed=3)
    assert asked.over(defaults) == Sampling(max_tokens=5, temperature=0.9, voice="Ethan", seed=3)
    assert asked.only(params("voice", "speed")) == Sampling(voice="Ethan")
    assert asked.asked() == {"max_tokens": 5, "voice": "Ethan", "seed": 3}


def test_what_every_engine_honours_or_reads_is_named_by_sampling_fields() -> None:
    """Every engine's declarations are fields of the struct (its heartbeat announces them, the
    gateway refuses any other a client sets): nothing an engine declares can be misspelt."""
    assert EVERY_ENGINE <= FIELDS and HONOURED <= FIELDS
    for name in [
        *GENERIC.values(),
        *(e for f in FAMILIES.values() for p in f.parts.values() for e in p.values()),
    ]:
        import_object(name)
    engines, seen = [Engine], []
    while engines:
        cls = engines.pop()
        seen.append(cls)
        engines.extend(cls.__subclasses__())
        assert cls.request_keys <= FIELDS and cls.honours <= FIELDS, cls
    assert len(seen) > 15  # every engine and family part was reached
