"""The OmniPipeline CRD, generated from the pipeline spec model; crds/omnipipeline.yaml is its
output (`omni crd > crds/omnipipeline.yaml`) and a test keeps the two equal.

pydantic writes JSON Schema; Kubernetes wants a structural OpenAPI v3 schema. `structural`
translates: references inlined, Optional as `nullable`, no titles, free-form maps as
`x-kubernetes-preserve-unknown-fields`, `exclusiveMinimum` as OpenAPI v3's boolean. CEL rules
say what CEL can; the operator checks the rest (cycles, unknown stages) and reports InvalidSpec.
"""

from __future__ import annotations

from typing import Any, Final

from omni_pipeline.spec import PipelineSpec

from .status import PipelineStatus

GROUP: Final = "omnipipeline.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "OmniPipeline"
PLURAL: Final = "omnipipelines"
SINGULAR: Final = "omnipipeline"
SHORT_NAME: Final = "omp"

_KEEP: Final = (
    "type",
    "description",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "format",
)

# Rules checked by the API server itself (CEL), with the message a user sees.
_RULES: Final[dict[str, list[dict[str, str]]]] = {
    "InputSpec": [
        {
            "rule": "self.window == -1 || self.window > 0",
            "message": "window must be -1 (full) or a positive number",
        }
    ],
    "PipelineSpec": [
        {
            "rule": "self.stages.exists(s, s.inputs.exists(i, i.from == 'request'))",
            "message": "no stage reads `request` (add inputs: [{from: request}])",
        },
        {
            "rule": "self.stages.exists(s, has(s.finalOutput))",
            "message": "no stage has finalOutput, so nothing reaches the client",
        },
    ],
}


def structural(schema: dict[str, Any], defs: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """One pydantic JSON Schema node -> a Kubernetes structural schema node."""
    if "$ref" in schema:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        inner = structural(defs[ref], defs, ref)
        return {**inner, **_annotations(schema)}
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {schema}")
        return {**structural(options[0], defs), **_annotations(schema), "nullable": True}
    out: dict[str, Any] = {k: schema[k] for k in _KEEP if k in schema}
    if "exclusiveMinimum" in schema:
        out["minimum"], out["exclusiveMinimum"] = schema["exclusiveMinimum"], True
    if schema.get("default") is not None:
        out["default"] = schema["default"]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        out["type"] = "object"
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props:
            out["properties"] = {k: structural(v, defs) for k, v in props.items()}
            if schema.get("required"):
                out["required"] = list(schema["required"])
        elif isinstance(extra, dict):
            out["additionalProperties"] = structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = structural(schema["items"], defs)
    elif kind is None and "enum" not in schema:
        out["x-kubernetes-preserve-unknown-fields"] = True  # Any
    if name in _RULES:
        out["x-kubernetes-validations"] = _RULES[name]
    return out


def _annotations(schema: dict[str, Any]) -> dict[str, Any]:
    """What an outer node (a field) adds to the type it refers to: its description and default."""
    out = {}
    if "description" in schema:
        out["description"] = schema["description"]
    if schema.get("default") is not None:
        out["default"] = schema["default"]
    return out


def spec_schema() -> dict[str, Any]:
    raw = PipelineSpec.model_json_schema(by_alias=True, mode="validation")
    spec = structural(raw, raw.get("$defs", {}), "PipelineSpec")
    stages = spec["properties"]["stages"]
    stages["x-kubernetes-list-type"] = "map"
    stages["x-kubernetes-list-map-keys"] = ["name"]
    return spec


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    raw_status = PipelineStatus.model_json_schema(by_alias=True, mode="serialization")
    status = structural(raw_status, raw_status.get("$defs", {}))
    for field, key in (("conditions", "type"), ("stages", "name")):
        status["properties"][field]["x-kubernetes-list-type"] = "map"
        status["properties"][field]["x-kubernetes-list-map-keys"] = [key]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "listKind": f"{KIND}List",
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
                        {"name": "Stages", "type": "string", "jsonPath": ".status.stagesReady"},
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.gatewayURL"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A multi-stage omni-modality model pipeline, served per stage.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }
