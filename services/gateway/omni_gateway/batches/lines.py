"""A batch's input file read as OpenAI reads it, and the lines its output and error files hold.

Input: JSONL, one request a line, `{"custom_id", "method": "POST", "url", "body"}`, every url
the batch's endpoint, every custom_id its own. A file with any bad line fails the whole batch
in `validating`, every bad line named (`BatchError`s: code, message, param, line number from 1);
a body the endpoint refuses is that line's own error, found when it runs.

Output: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` a
line; a line the endpoint answered with an error goes to the error file in the same shape, and
a line that never ran (the batch expired or was cancelled first) with `response: null` and the
reason in `error`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Final

import msgspec

MAX_CUSTOM_ID: Final = 512
_JSON: Final = msgspec.json.Encoder()


class InputLine(msgspec.Struct, frozen=True):
    index: int
    custom_id: str
    body: dict[str, Any]


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """A `BatchError`: why a batch failed (`line`: the input line at fault, from 1)."""
    return {"code": code, "message": message, "param": param, "line": line}


def read_input(data: bytes, endpoint: str, max_lines: int) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """The file's requests, or the errors that fail the batch (each bad line named)."""
    lines: list[InputLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        return [], [batch_error("invalid_file", f"the file is not UTF-8 text ({exc.reason})")]
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not numbered:
        return [], [batch_error("empty_file", "the file holds no request")]
    if len(numbered) > max_lines:
        msg = f"the file holds {len(numbered)} requests; at most {max_lines}"
        return [], [batch_error("too_many_requests", msg)]
    for n, raw in numbered:
        try:
            req = json.loads(raw)
        except ValueError as exc:
            errors.append(batch_error("invalid_json_line", f"line {n} is not JSON ({exc.msg})", n))
            continue
        if not isinstance(req, dict):
            errors.append(batch_error("invalid_json_line", f"line {n} is not a JSON object", n))
            continue
        bad = _line_error(req, endpoint, n, seen)
        if bad is not None:
            errors.append(bad)
            continue
        seen.add(req["custom_id"])
        lines.append(InputLine(len(lines), req["custom_id"], req["body"]))
    return ([], errors) if errors else (lines, [])


def _line_error(req: dict[str, Any], endpoint: str, n: int, seen: set[str]) -> dict[str, Any] | None:
    custom_id, unknown = req.get("custom_id"), sorted(set(req) - {"custom_id", "method", "url", "body"})
    if not isinstance(custom_id, str) or not custom_id:
        bad = ("missing_required_parameter", "custom_id must be a non-empty string", "custom_id")
    elif len(custom_id) > MAX_CUSTOM_ID:
        bad = ("invalid_value", f"custom_id is over {MAX_CUSTOM_ID} characters", "custom_id")
    elif custom_id in seen:
        bad = ("duplicate_custom_id", f"custom_id '{custom_id}' is not unique in the file", "custom_id")
    elif req.get("method") != "POST":
        bad = ("invalid_value", f"method must be POST, got {req.get('method')!r}", "method")
    elif req.get("url") != endpoint:
        bad = ("mismatched_endpoint", f"url {req.get('url')!r} is not the batch's endpoint {endpoint}", "url")
    elif not isinstance(req.get("body"), dict):
        bad = ("missing_required_parameter", "body must be a JSON object", "body")
    elif unknown:
        bad = ("invalid_value", f"unrecognized field {unknown[0]!r}", unknown[0])
    else:
        return None
    code, message, param = bad
    return batch_error(code, f"line {n}: {message}", n, param)


def answered(
    custom_id: str, status: int, request_id: str | None, body: Any, error: dict[str, Any] | None = None
) -> bytes:
    """The line of a request the endpoint answered (the output file's if 2xx, else the error
    file's); `body` may be the answer's JSON as it came (msgspec.Raw), not parsed again.
    `error`: why an answered request failed after all (a video job that failed)."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    return _line(custom_id, response, error)


def not_run(custom_id: str, code: str, message: str) -> bytes:
    """The error file's line of a request that never ran (or could not be answered)."""
    return _line(custom_id, None, {"code": code, "message": message})


def _line(custom_id: str, response: dict[str, Any] | None, error: dict[str, Any] | None) -> bytes:
    line_id = f"batch_req_{secrets.token_hex(12)}"
    return _JSON.encode({"id": line_id, "custom_id": custom_id, "response": response, "error": error})


class _Usage(msgspec.Struct):
    """An answer's `usage`, by chat's names (prompt/completion) or the image API's (input/output)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None
    input_tokens_details: dict[str, Any] | None = None
    output_tokens_details: dict[str, Any] | None = None


class _Body(msgspec.Struct):
    usage: _Usage | None = None


class _Response(msgspec.Struct):
    body: _Body | None = None


class _Answered(msgspec.Struct):
    """An output line as far as its usage: the rest of it (an answer's audio) is skipped unread."""

    response: _Response | None = None


_ANSWERED: Final = msgspec.json.Decoder(_Answered)


def summed_usage(outputs: list[bytes]) -> dict[str, Any]:
    """OpenAI's batch `usage`: the tokens of every line answered (speech and video answers carry
    none), chat's and the image API's names read alike."""
    read = written = cached = reasoning = 0
    for raw in outputs:
        response = _ANSWERED.decode(raw).response
        u = response.body.usage if response is not None and response.body is not None else None
        if u is None:
            continue
        read += u.prompt_tokens + u.input_tokens
        written += u.completion_tokens + u.output_tokens
        cached += sum(
            (d or {}).get("cached_tokens") or 0 for d in (u.prompt_tokens_details, u.input_tokens_details)
        )
        reasoning += sum(
            (d or {}).get("reasoning_tokens") or 0
            for d in (u.completion_tokens_details, u.output_tokens_details)
        )
    return {
        "input_tokens": read,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": written,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": read + written,
    }
