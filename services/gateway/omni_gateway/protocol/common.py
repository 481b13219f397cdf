"""What the request models of every endpoint share."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo


def refuse_unless_off(value: Any, info: ValidationInfo, off: dict[str, tuple[Any, ...]]) -> None:
    """A field this server does not serve is taken only at the value that turns it off (or
    null): anything else is a 400 naming it, never a silent no."""
    allowed = off[str(info.field_name)]
    if value is not None and value not in allowed:
        say = " or ".join(repr(v) for v in allowed) if allowed else "null"
        raise ValueError(f"not served by this server; leave it out (or send {say})")
