"""A batch's input file read as OpenAI reads it (omni_gateway.batches.lines), without a gateway:
what passes, and each kind of bad line named with its number."""

from __future__ import annotations

import json
from typing import Any

from omni_gateway.batches.lines import answered, not_run, read_input, summed_usage

URL = "/v1/chat/completions"


def line(custom_id: Any = "a", **changes: Any) -> bytes:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"x": 1}, **changes}
    ).encode()


def errors_of(data: bytes, max_lines: int = 10) -> list[tuple[int | None, str, str | None]]:
    lines, errors = read_input(data, URL, max_lines)
    assert not (lines and errors)
    return [(e["line"], e["code"], e["param"]) for e in errors]


def test_good_lines_are_read_in_order_blank_ones_skipped() -> None:
    lines, errors = read_input(line("a") + b"\n\n  \n" + line("b") + b"\n", URL, 10)
    assert errors == [] and [(x.index, x.custom_id, x.body) for x in lines] == [
        (0, "a", {"x": 1}),
        (1, "b", {"x": 1}),
    ]


def test_every_bad_line_is_named_by_its_number() -> None:
    data = b"\n".join(
        [
            line("a"),
            b"[1, 2]",
            line(""),
            line("b", method="GET"),
            line("c", body="text"),
            line("d", extra=1),
            line("e", url="/v1/images/generations"),
            line("a"),
        ]
    )
    assert errors_of(data) == [
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "invalid_value", "method"),
        (5, "missing_required_parameter", "body"),
        (6, "invalid_value", "extra"),
        (7, "mismatched_endpoint", "url"),
        (8, "duplicate_custom_id", "custom_id"),
    ]


def test_a_whole_file_is_refused_for_what_is_wrong_with_it_whole() -> None:
    assert errors_of(b"") == [(None, "empty_file", None)]
    assert errors_of(b"\xff\xfe") == [(None, "invalid_file", None)]
    assert errors_of(b"\n".join(line(str(i)) for i in range(3)), max_lines=2) == [
        (None, "too_many_requests", None)
    ]


def test_output_lines_are_openais_shape() -> None:
    ok = json.loads(answered("a", 200, "req-1", {"y": 2}))
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"y": 2}}
    gone = json.loads(not_run("b", "batch_expired", "too late"))
    assert gone["response"] is None and gone["error"] == {"code": "batch_expired", "message": "too late"}


def test_usage_sums_chats_and_images_tokens_and_skips_answers_without() -> None:
    chat = {
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 6},
            "completion_tokens_details": {"reasoning_tokens": 1},
        },
        "choices": [{"message": {"audio": {"data": "UklGRg=="}}}],
    }
    image = {"usage": {"input_tokens": 7, "output_tokens": 0, "input_tokens_details": {"text_tokens": 7}}}
    speech = {"audio": "UklGRg==", "content_type": "audio/wav"}
    outputs = [answered(c, 200, "r", b) for c, b in (("a", chat), ("b", image), ("c", speech))]
    assert summed_usage(outputs) == {
        "input_tokens": 17,
        "input_tokens_details": {"cached_tokens": 6},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 21,
    }
    assert summed_usage([])["total_tokens"] == 0
