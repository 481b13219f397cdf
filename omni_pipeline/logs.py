"""One log format for every omni process; the level comes from OMNI_LOG_LEVEL (default INFO).

A line logged while a request is being handled names it, and its trace when tracing is on:
`... omni.stage [request=abc-1f2e trace=4bf9...]: ...`, so the lines five processes wrote about
one request can be found with one grep, and its trace opened from any of them.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar
from typing import Final

from opentelemetry import trace

REQUEST_ID: Final[ContextVar[str | None]] = ContextVar("omni_request_id", default=None)
"""The request the running code works for; set by whoever handles one (a task, a callback)."""


class RequestIds(logging.Filter):
    """Puts `ids` on each record: the request and trace it was logged for, or nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = []
        if rid := REQUEST_ID.get():
            ids.append(f"request={rid}")
        if (span := trace.get_current_span().get_span_context()).is_valid:
            ids.append(f"trace={span.trace_id:032x}")
        record.ids = f" [{' '.join(ids)}]" if ids else ""
        return True


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s%(ids)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIds) for f in handler.filters):
            handler.addFilter(RequestIds())
