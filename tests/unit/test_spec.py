"""Pipeline spec validation: every bad file is refused with the stage and field named."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_pipeline.spec import OutputKind, SpecError, load_pipeline, parse_pipeline

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny-omni.yaml"


def base() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))


def refused(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc, "p.yaml")
    return str(info.value)


def test_example_is_valid() -> None:
    p = load_pipeline(EXAMPLE)
    assert [s.name for s in p.spec.stages] == ["thinker", "talker", "vocoder"]
    assert p.spec.stage("talker").inputs[0].window == 8
    assert p.spec.stage("thinker").max_inflight == 4


def test_camel_case_round_trip() -> None:
    p = load_pipeline(EXAMPLE)
    dumped = p.model_dump(by_alias=True, exclude_none=True)
    assert "servedModelName" in dumped["spec"]
    assert dumped["spec"]["stages"][0]["finalOutput"] == "text"
    assert parse_pipeline(dumped) == p


def test_unknown_from() -> None:
    d = base()
    d["spec"]["stages"][1]["inputs"][0]["from"] = "thinkr"
    msg = refused(d)
    assert "stage 'talker'" in msg and "inputs[0].from" in msg and "thinkr" in msg


def test_cycle() -> None:
    d = base()
    d["spec"]["stages"][1]["inputs"].append({"from": "vocoder"})
    msg = refused(d)
    assert "cycle" in msg and "talker" in msg and "vocoder" in msg


def test_duplicate_stage_names() -> None:
    d = base()
    d["spec"]["stages"][2]["name"] = "talker"
    msg = refused(d)
    assert "stage 'talker'" in msg and "duplicate" in msg


@pytest.mark.parametrize("window", [0, -2, -10])
def test_bad_window(window: int) -> None:
    d = base()
    d["spec"]["stages"][2]["inputs"][0]["window"] = window
    msg = refused(d)
    assert "stage 'vocoder'" in msg and "inputs[0].window" in msg


@pytest.mark.parametrize(
    ("window", "first", "says"),
    [
        (8, 9, "firstWindow (9) must be at most window (8)"),
        (-1, 1, "firstWindow (1) must be at most window (-1), on a windowed edge"),
        (8, 0, "firstWindow"),
    ],
)
def test_a_first_window_past_its_window_is_refused(window: int, first: int, says: str) -> None:
    d = base()
    d["spec"]["stages"][2]["inputs"][0] |= {"window": window, "firstWindow": first}
    msg = refused(d)
    assert "stage 'vocoder'" in msg and says in msg, msg


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_niceness_outside_nice_1s_range_is_refused(nice: int) -> None:
    """0-19 only: a negative one needs privileges a stage does not have."""
    d = base()
    d["spec"]["stages"][0]["nice"] = nice
    msg = refused(d)
    assert "stage 'thinker'" in msg and "nice" in msg


def test_unknown_engine_kind() -> None:
    d = base()
    d["spec"]["stages"][0]["engine"]["kind"] = "tensorrt"
    msg = refused(d)
    assert "stage 'thinker'" in msg and "engine.kind" in msg and "tensorrt" in msg


def test_no_stage_reads_request() -> None:
    d = base()
    d["spec"]["stages"][0]["inputs"] = [{"from": "vocoder"}]
    msg = refused(d)
    assert "request" in msg


def test_no_final_output() -> None:
    d = base()
    for s in d["spec"]["stages"]:
        s.pop("finalOutput", None)
    msg = refused(d)
    assert "finalOutput" in msg


def test_undefined_connector() -> None:
    d = base()
    d["spec"]["stages"][1]["inputs"][0]["connector"] = "rdma"
    msg = refused(d)
    assert "stage 'talker'" in msg and "connector" in msg and "rdma" in msg


def test_unknown_field() -> None:
    d = base()
    d["spec"]["stages"][0]["maxInFlight"] = 3  # wrong case: a typo must not pass silently
    msg = refused(d)
    assert "stage 'thinker'" in msg and "maxInFlight" in msg


def test_torch_engine_needs_factory() -> None:
    d = base()
    del d["spec"]["stages"][2]["engine"]["factory"]
    assert "factory" in refused(d)


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="mapping"):
        parse_pipeline([1, 2])
    f = tmp_path / "bad.yaml"
    f.write_text("spec: [unclosed")
    with pytest.raises(SpecError, match="YAML"):
        load_pipeline(f)
    with pytest.raises(SpecError, match="cannot read"):
        load_pipeline(tmp_path / "missing.yaml")


def test_needed_stages_follow_modalities() -> None:
    spec = load_pipeline(EXAMPLE).spec
    assert spec.needed_stages({OutputKind.TEXT}) == ["thinker"]
    assert spec.needed_stages({OutputKind.TEXT, OutputKind.AUDIO}) == ["thinker", "talker", "vocoder"]
    assert spec.output_kinds() == {OutputKind.TEXT, OutputKind.AUDIO}


def with_encoder() -> dict[str, Any]:
    """tiny-omni with an encoder stage in front of the thinker, skipped without media."""
    d = base()
    stages = d["spec"]["stages"]
    encoder = copy.deepcopy(stages[0]) | {"name": "encoder", "skipWithoutMedia": True}
    del encoder["finalOutput"]
    stages[0]["inputs"].append({"from": "encoder"})
    stages.insert(0, encoder)
    return d


def test_a_request_without_media_skips_the_stages_that_say_so() -> None:
    spec = parse_pipeline(with_encoder()).spec
    both = {OutputKind.TEXT, OutputKind.AUDIO}
    assert spec.needed_stages(both) == ["encoder", "thinker", "talker", "vocoder"]
    assert spec.needed_stages(both, media=False) == ["thinker", "talker", "vocoder"]
    assert spec.needed_stages({OutputKind.TEXT}, media=False) == ["thinker"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            lambda st: st[0].update(inputs=[{"from": "thinker"}]),
            "stage 'encoder': skipWithoutMedia: it does not read",
        ),
        (
            lambda st: st[0].update(finalOutput="text"),
            "stage 'encoder': skipWithoutMedia: a stage with finalOutput",
        ),
        (
            lambda st: st[1].update(inputs=[{"from": "encoder"}]),
            "stage 'thinker': inputs: every input is a skip",
        ),
        (
            lambda st: st[1]["inputs"][1].update(media=False),
            "stage 'thinker': inputs[1].media: only a `request`",
        ),
        (
            lambda st: st[2]["inputs"].append({"from": "request", "media": False}),
            "stage 'talker': inputs[1].media: false, but",
        ),
    ],
)
def test_a_stage_that_skips_requests_without_media_must_leave_its_consumers_fed_and_media_go_somewhere(
    change: Any, named: str
) -> None:
    d = with_encoder()
    change(d["spec"]["stages"])
    assert named in refused(d)


@pytest.mark.parametrize(
    ("pods", "named"),
    [
        ({"volumeMounts": [{"name": "weights", "mountPath": "/m"}]}, "volumeMounts[0].name: no volume named"),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "volumes[0].name: 'dshm' is reserved"),
        ({"env": [{"value": "x"}]}, "env[0].name: required"),
    ],
)
def test_bad_pods_section(pods: dict[str, Any], named: str) -> None:
    d = base()
    d["spec"]["pods"] = pods
    assert named in refused(d)


def test_otlp_endpoint_is_a_url() -> None:
    d = base()
    d["spec"]["observability"] = {"otlpEndpoint": "http://collector.monitoring:4318"}
    assert parse_pipeline(d).spec.observability.otlp_endpoint == "http://collector.monitoring:4318"
    d["spec"]["observability"] = {"otlpEndpoint": "collector:4318"}
    assert "observability.otlpEndpoint" in refused(d)


def test_autoscaling_range() -> None:
    d = base()
    d["spec"]["stages"][1]["autoscaling"] = {"minReplicas": 5, "maxReplicas": 2}
    assert "stage 'talker'" in (msg := refused(d)) and "minReplicas: 5 is more than maxReplicas 2" in msg
    d["spec"]["stages"][1]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    assert "minReplicas: 0 needs keda" in refused(d)
    d["spec"]["stages"][1]["autoscaling"]["keda"] = {"prometheusAddress": "http://prom:9090"}
    assert parse_pipeline(d).spec.stage("talker").autoscaling.keda is not None  # type: ignore[union-attr]
