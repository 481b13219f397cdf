"""What the request models of every endpoint share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError, ValidationInfo
from starlette.requests import Request

from omni_gateway.errors import BadRequest


def refuse_unless_off(value: Any, info: ValidationInfo, off: dict[str, tuple[Any, ...]]) -> None:
    """A field this server does not serve is taken only at the value that turns it off (or
    null): anything else is a 400 naming it, never a silent no."""
    allowed = off[str(info.field_name)]
    if value is not None and value not in allowed:
        say = " or ".join(repr(v) for v in allowed) if allowed else "null"
        raise ValueError(f"not served by this server; leave it out (or send {say})")


def parse(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    """`model` from `fields` (a form's, or JSON a route read itself), a ValidationError as the
    400 the gateway sends for any body: naming the field, or the field a check across fields
    names first (`size: ...`)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            msg = "unrecognized request argument"
        named, sep, rest = msg.partition(": ")
        if param is None and sep and named in model.model_fields:
            param, msg = named, rest
        raise BadRequest(f"{param}: {msg}" if param else msg, param=param) from None


async def json_object(request: Request, not_json: str = "the body must be JSON") -> dict[str, Any]:
    """The body, a JSON object; a 400 where it is not JSON (`not_json` says so) or not an object."""
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest(not_json) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
