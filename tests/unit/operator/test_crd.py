"""The CRD: generated from the spec model, kept equal to crds/omnipipeline.yaml, valid for
Kubernetes, and accepting exactly the pipelines the spec model accepts (for what a schema can
say; CEL and the operator say the rest)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from omni_operator.crd import crd, spec_schema
from tests.helpers import ROOT

CRD_FILE = ROOT / "crds" / "omnipipeline.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def openapi() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_file_equals_the_generated_one() -> None:
    assert yaml.safe_load(CRD_FILE.read_text()) == crd(), "regenerate: omni crd > crds/omnipipeline.yaml"


def test_crd_is_valid_kubernetes() -> None:
    kubernetes_validate.validate(crd(), "1.33", strict=True)


def test_names_columns_and_status() -> None:
    spec = crd()["spec"]
    assert spec["names"]["shortNames"] == ["omp"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Mode",
        "Stages",
        "Endpoint",
        "Age",
    ]


def test_every_field_has_a_description() -> None:
    missing = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, child in node.get("properties", {}).items():
            if not child.get("description"):
                missing.append(f"{path}.{key}")
            walk(child, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    walk(spec_schema(), "spec")
    assert missing == []


def test_stages_are_a_list_keyed_by_name_and_rules_are_cel() -> None:
    spec = spec_schema()
    stages = spec["properties"]["stages"]
    assert stages["x-kubernetes-list-type"] == "map" and stages["x-kubernetes-list-map-keys"] == ["name"]
    window_rule = stages["items"]["properties"]["inputs"]["items"]["x-kubernetes-validations"][0]["rule"]
    assert window_rule == "self.window == -1 || self.window > 0"
    assert len(spec["x-kubernetes-validations"]) == 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_resources(example: Path) -> None:
    doc = yaml.safe_load(example.read_text())
    jsonschema.Draft4Validator(openapi()).validate(doc)


def _invalid(mutate: Any) -> None:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text()))
    mutate(doc["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(openapi()).validate(doc)


def test_schema_refuses_what_it_can_say() -> None:
    _invalid(lambda s: s["stages"][0].update(replicas=-1))
    _invalid(lambda s: s["stages"][0]["engine"].update(kind="tensorrt"))
    _invalid(lambda s: s["stages"][0].update(name="Not_A_DNS_Label"))
    _invalid(lambda s: s.update(stages=[]))
    _invalid(lambda s: s["connectors"]["default"].update(kind="rdma"))
