"""Which GPUs each stage replica of a single-node pipeline sees: packed in file order, or
placed as the file says (vLLM-Omni's `devices`), shared only on purpose and in stated shares;
a placement that cannot work is refused with the stage named."""

from __future__ import annotations

from typing import Any

import pytest

from omni_pipeline.placement import PlacementError, place
from omni_pipeline.spec import PipelineSpec, SpecError, parse_pipeline
from tests.unit.test_spec import base


def spec(**stages: dict[str, Any]) -> dict[str, Any]:
    """The tiny-omni example with each named stage's fields set (thinker, talker, vocoder)."""
    doc = base()
    for s in doc["spec"]["stages"]:
        s.update(stages.get(s["name"], {}))
    return doc


def parsed(doc: dict[str, Any]) -> PipelineSpec:
    return parse_pipeline(doc, "p.yaml").spec


def refused(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc, "p.yaml")
    return str(info.value)


def gpus(n: int, **more: Any) -> dict[str, Any]:
    return {"resources": {"gpus": n}, **more}


def test_stages_are_packed_in_file_order() -> None:
    p = place(parsed(spec(thinker=gpus(1), talker=gpus(1, replicas=2))), available=4)
    assert p.devices == {("thinker", 0): [0], ("talker", 0): [1], ("talker", 1): [2], ("vocoder", 0): []}
    assert p.device_count == 3
    assert p.visible("talker", 1, ["3", "5", "7", "9"]) == "7"  # ids of the machine's own list
    assert p.visible("vocoder", 0, ["3", "5", "7", "9"]) == ""


def test_vllm_omnis_layout_thinker_alone_talker_and_vocoder_sharing() -> None:
    shared = {"devices": "1", "shareDevice": True}
    doc = spec(
        thinker=gpus(1, devices="0"),
        talker=gpus(1, **shared, gpuMemoryFraction=0.6),
        vocoder=gpus(1, **shared, gpuMemoryFraction=0.3),
    )
    p = place(parsed(doc), available=2)
    assert p.devices == {("thinker", 0): [0], ("talker", 0): [1], ("vocoder", 0): [1]}
    assert p.device_count == 2


def test_packing_skips_the_devices_placed_by_hand() -> None:
    p = place(parsed(spec(thinker=gpus(1), talker=gpus(1, devices="0"))), available=2)
    assert p.devices[("thinker", 0)] == [1] and p.devices[("talker", 0)] == [0]


def test_more_than_the_machine_has_names_the_stage() -> None:
    with pytest.raises(PlacementError, match=r"stage 'talker': resources.gpus: replica 1 needs 1, but"):
        place(parsed(spec(thinker=gpus(1), talker=gpus(1, replicas=2))), available=2)
    with pytest.raises(PlacementError, match=r"stage 'talker': devices: device 3 asked for, but there are 2"):
        place(parsed(spec(talker=gpus(1, devices="3"))), available=2)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            {"thinker": gpus(1, devices="0"), "talker": gpus(1, devices="0")},
            "stage 'thinker': devices: device 0 is used by 'thinker' replica 0, 'talker' replica 0; "
            "set shareDevice: true",
        ),
        (
            {
                "thinker": gpus(1, devices="0", shareDevice=True),
                "talker": gpus(1, devices="0", shareDevice=True),
            },
            "stage 'thinker': gpuMemoryFraction: required on a shared device",
        ),
        (
            {
                "thinker": gpus(1, devices="0", shareDevice=True, gpuMemoryFraction=0.7),
                "talker": gpus(1, devices="0", shareDevice=True, gpuMemoryFraction=0.5),
            },
            "gpuMemoryFraction: the shares on device 0 ('thinker' replica 0, 'talker' replica 0) sum to 1.2",
        ),
        ({"talker": gpus(1, devices="0,1")}, "stage 'talker': devices: 2 listed, but 1 replicas of"),
        ({"talker": {"devices": "0,x"}}, "devices"),
    ],
)
def test_bad_placements_are_refused_with_the_stage_named(stages: dict[str, Any], message: str) -> None:
    assert message in refused(spec(**stages))


def test_placement_is_single_node_only() -> None:
    doc = spec(talker=gpus(1, devices="0"))
    doc["spec"]["mode"] = "Distributed"
    assert "stage 'talker': devices, shareDevice: SingleNode only" in refused(doc)
