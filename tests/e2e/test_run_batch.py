"""`omni run-batch`, as vllm run-batch's users run it: a file of requests (chat completions and
speech, mixed, one the endpoint refuses) to a file of results in the input's order, through the
Batch API's own code path on `omni serve`; a file with a bad line writes nothing and names it."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import OMNI, ROOT

pytestmark = pytest.mark.slow


def chat(custom_id: str, **body: object) -> dict[str, object]:
    messages = [{"role": "user", "content": f"Hello, {custom_id}"}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-omni", "messages": messages, "max_tokens": 6, **body},
    }


def speech(custom_id: str) -> dict[str, object]:
    body = {"model": "tiny-omni", "input": "Hi", "voice": "alloy", "response_format": "wav"}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/audio/speech", "body": body}


def run_batch(demo_dir: Path, tmp_path: Path, data: bytes) -> tuple[subprocess.CompletedProcess[str], Path]:
    shutil.copy(ROOT / "examples" / "tiny-omni.yaml", tmp_path / "tiny-omni.yaml")
    (tmp_path / "in.jsonl").write_bytes(data)
    out = tmp_path / "out.jsonl"
    args = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), str(tmp_path / "tiny-omni.yaml")]
    done = subprocess.run([*OMNI, *args], cwd=demo_dir, capture_output=True, text=True, timeout=300)
    return done, out


def test_a_file_of_requests_becomes_a_file_of_results_in_order(demo_dir: Path, tmp_path: Path) -> None:
    lines = [chat("a"), speech("b"), chat("c", temperature=-1), chat("d"), speech("e")]
    done, out = run_batch(demo_dir, tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode())
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", "c", "d", "e"]
    status = {r["custom_id"]: r["response"]["status_code"] for r in results}
    assert status == {"a": 200, "b": 200, "c": 400, "d": 200, "e": 200}
    assert results[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert base64.b64decode(results[1]["response"]["body"]["audio"])[:4] == b"RIFF"
    assert results[2]["response"]["body"]["error"]["param"] == "temperature"


def test_a_file_with_a_bad_line_writes_nothing_and_names_it(demo_dir: Path, tmp_path: Path) -> None:
    done, out = run_batch(demo_dir, tmp_path, json.dumps(chat("a")).encode() + b"\n{oops\n")
    assert done.returncode == 1 and not out.exists()
    assert "line 2" in done.stderr and "not JSON" in done.stderr, done.stderr[-2000:]
