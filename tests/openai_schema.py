"""Validation against OpenAI's own OpenAPI description (../shared/reference/openai-openapi.yaml).

Two adjustments, both from the reference's README: `nullable: true` (OpenAPI 3.0, which a JSON
Schema 2020-12 validator ignores) means "or null"; and image sizes outside OpenAI's own list
are not a conformance failure (a diffusion model serves other sizes), so the size enums go.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.helpers import ROOT

REFERENCE = ROOT.parent / "shared" / "reference" / "openai-openapi.yaml"
_URI = "urn:openai-openapi"


def _adjusted(node: Any, key: str = "") -> Any:
    if isinstance(node, list):
        return [_adjusted(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _adjusted(v, k) for k, v in node.items() if k != "nullable"}
    if key == "size" and "enum" in out:
        del out["enum"]
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry() -> Registry:
    doc = yaml.load(REFERENCE.read_text(), Loader=yaml.CSafeLoader)
    resource = Resource.from_contents(_adjusted(doc), default_specification=DRAFT202012)
    return Registry().with_resource(_URI, resource)


def violations(body: Any, schema: str) -> str | None:
    """Why `body` is not a valid `#/components/schemas/<schema>`, or None when it is."""
    validator = Draft202012Validator({"$ref": f"{_URI}#/components/schemas/{schema}"}, registry=_registry())
    error = best_match(validator.iter_errors(body))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{schema} at '{where}': {error.message[:300]}"
