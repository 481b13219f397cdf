"""`omni run-batch -i requests.jsonl -o results.jsonl PIPELINE`: a file of requests run to a file
of results on this machine, as `vllm run-batch` does, through the Batch API's own code path:
the pipeline served (`omni serve`, on a free port, its batch store in a temporary directory),
the file uploaded and run as one batch per endpoint its lines name, each result line (an
answer, or the error the endpoint gave) written in the input's order, then the pipeline
stopped. A file the Batch API refuses (a line that is not JSON, a repeated custom_id, ...)
writes nothing: each bad line is printed and the command exits 1.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import yaml

READY: Final = re.compile(r"ready at (http://\S+)/v1")
ENDED: Final = ("completed", "failed", "cancelled", "expired")
POLL_S: Final = 0.5


def _endpoints(data: bytes) -> dict[str, list[bytes]]:
    """The file's lines by the endpoint each names (a line that names none goes with the first,
    where the Batch API's validation names it)."""
    groups: dict[str, list[bytes]] = {}
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            url = None
        groups.setdefault(url if isinstance(url, str) else "", []).append(raw)
    if "" in groups and len(groups) > 1:
        groups[next(k for k in groups if k)].extend(groups.pop(""))
    return groups


@contextmanager
def _served(pipeline: Path, state: Path, timeout_s: float) -> Iterator[str]:
    """`omni serve` of the pipeline, its batches kept under `state`; yields its base URL."""
    doc = yaml.safe_load(pipeline.read_text())
    doc["spec"].setdefault("gateway", {})["batches"] = {
        **doc["spec"].get("gateway", {}).get("batches", {}),
        "stateDir": str(state),
        "store": "sqlite",
    }
    copy = state / pipeline.name
    copy.write_text(yaml.safe_dump(doc))
    log = (state / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_cli.main", "serve", str(copy), "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while (found := READY.search(Path(log.name).read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text()[-3000:]
                raise RuntimeError(f"omni serve did not become ready:\n{tail}")
            time.sleep(POLL_S)
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _run(client: httpx.Client, url: str, lines: list[bytes]) -> dict[str, Any]:
    """One batch of `lines` for endpoint `url`, run to its end."""
    data = b"".join(x + b"\n" for x in lines)
    f = client.post("/v1/files", files={"file": ("requests.jsonl", data)}, data={"purpose": "batch"})
    f.raise_for_status()
    asked = {"input_file_id": f.json()["id"], "endpoint": url, "completion_window": "24h"}
    batch = client.post("/v1/batches", json=asked)
    if batch.status_code == 400:  # an endpoint the Batch API does not run
        error = batch.json()["error"]
        return {"status": "failed", "errors": {"data": [{"message": error["message"], "line": None}]}}
    batch.raise_for_status()
    b = batch.json()
    while b["status"] not in ENDED:
        time.sleep(POLL_S)
        b = client.get(f"/v1/batches/{b['id']}").raise_for_status().json()
        counts = b.get("request_counts", {})
        done = counts.get("completed", 0) + counts.get("failed", 0)
        print(f"{url}: {b['status']} {done}/{counts.get('total', 0)}", file=sys.stderr)
    return dict(b)


def run_batch(pipeline: Path, input_path: Path, output_path: Path, timeout_s: float = 600) -> int:
    data = input_path.read_bytes()
    groups = _endpoints(data)
    with (
        tempfile.TemporaryDirectory(prefix="omni-run-batch-") as tmp,
        _served(pipeline, Path(tmp), timeout_s) as base,
    ):
        results: dict[str, bytes] = {}
        failed = False
        with httpx.Client(base_url=base, timeout=60) as client:
            for url, lines in groups.items():
                b = _run(client, url or "/v1/chat/completions", lines)
                if b["status"] != "completed":
                    failed = True
                    for e in (b.get("errors") or {}).get("data", []):
                        where = f"line {e['line']} of those for {url}: " if e.get("line") else ""
                        print(f"omni run-batch: {where}{e['message']}", file=sys.stderr)
                    continue
                for key in ("output_file_id", "error_file_id"):
                    if b.get(key):
                        for line in (
                            client.get(f"/v1/files/{b[key]}/content").raise_for_status().content.splitlines()
                        ):
                            results[json.loads(line)["custom_id"]] = line
    if failed:
        return 1
    order = [json.loads(x)["custom_id"] for x in data.splitlines() if x.strip()]
    output_path.write_bytes(b"".join(results[c] + b"\n" for c in order))
    print(f"omni run-batch: {len(order)} results in {output_path}", file=sys.stderr)
    return 0
