"""Typed service errors, mapped in one place to OpenAI's error body and HTTP status."""

from __future__ import annotations

from typing import Any

from omni_pipeline.control import ErrorCode


class OmniError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(OmniError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(OmniError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLarge(OmniError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ModelNotFound(OmniError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotServed(OmniError):
    """An endpoint this model has nothing to answer with (/tokenize without a tokenizer)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class NotFound(OmniError):
    """A resource that does not exist (a video job), or not for the caller's API key."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class NotReady(OmniError):
    """A resource not in the state the request needs (a video's content while it renders)."""

    status = 409
    type = "invalid_request_error"
    code = "not_ready"


class Conflict(OmniError):
    """A resource that exists already (an uploaded voice's name)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class Overloaded(OmniError):
    """Every replica of a needed stage is full: come back later."""

    status = 429
    type = "rate_limit_error"
    code = "pipeline_saturated"


class Unavailable(OmniError):
    """A needed stage has no live replica."""

    status = 503
    type = "server_error"
    code = "stage_unavailable"


class Unsupported(OmniError):
    """The pipeline cannot do what was asked (a sleep deeper than a stage's engine can do)."""

    status = 501
    type = "server_error"
    code = "not_implemented"


class StageFailed(OmniError):
    """A stage failed this request (its message says which and why)."""

    status = 500
    type = "server_error"
    code = ErrorCode.STAGE_ERROR


class Timeout(OmniError):
    status = 504
    type = "server_error"
    code = ErrorCode.DEADLINE_EXCEEDED


def error_from(exc: BaseException) -> OmniError:
    if isinstance(exc, OmniError):
        return exc
    return StageFailed(f"{type(exc).__name__}: {exc}", code="internal_error")
