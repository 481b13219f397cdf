"""The gateway's guards against a real gateway and stage: API keys (401 without one, probes
open) and the request body limit (413, declared or streamed); a bad key setting stops it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.deployment import deployed
from tests.helpers import HTTP, OMNI, ROOT

PIPELINE = ROOT / "tests" / "data" / "echo.yaml"
KEYS = ("k-first", "k-second")


@pytest.fixture
def gateway(nats_url: str, tmp_path: Path) -> Iterator[str]:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated monthly\n{KEYS[0]}\n\n{KEYS[1]}\n")
    env = {"OMNI_API_KEYS_FILE": str(keys)}
    with deployed(PIPELINE, {"echo": 1}, 1, nats_url, ROOT, tmp_path, env) as d:
        yield d.base


def test_api_keys(gateway: str) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content
    bad = openai.OpenAI(base_url=f"{gateway}/v1", api_key="k-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    r = HTTP.get(f"{gateway}/replicas")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.headers["x-request-id"]
    assert HTTP.get(f"{gateway}/health").status_code == 200  # probes need no key
    for path in ("sleep", "wakeup"):  # the control endpoints too, whatever the body
        r = HTTP.post(f"{gateway}/v1/omni/{path}", json={"stage_ids": ["echo"]})
        assert r.status_code == 401, r.text
    keyed = {"Authorization": f"Bearer {KEYS[1]}"}
    for path in ("sleep", "wakeup"):
        r = HTTP.post(f"{gateway}/v1/omni/{path}", json={"stage_ids": ["echo"]}, headers=keyed, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "SUCCESS", r.text
    assert "omni_gateway_requests_total" in HTTP.get(f"{gateway}/metrics").text
    assert 'status="401"' in HTTP.get(f"{gateway}/metrics").text


def test_oversized_bodies_get_413(gateway: str) -> None:
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    big = {"model": "echo", "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = HTTP.post(f"{gateway}/v1/chat/completions", json=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the gateway counts as it reads
        yield b'{"model": "echo", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 10_000
        yield b'"}]}'

    r = HTTP.post(f"{gateway}/v1/chat/completions", content=chunked(), headers=headers)
    assert r.status_code == 413
    small = {"model": "echo", "messages": [{"role": "user", "content": "x" * 1000}]}
    assert HTTP.post(f"{gateway}/v1/chat/completions", json=small, headers=headers).status_code == 200


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_an_unreadable_key_file_stops_the_gateway(nats_url: str, tmp_path: Path, command: str) -> None:
    """In one line, before anything starts: `omni serve` starts no stage (it would say so, and
    end otherwise)."""
    args = {
        "gateway": ["gateway", "--pipeline", str(PIPELINE), "--port", "0", "--nats", nats_url],
        "serve": ["serve", str(PIPELINE), "--port", "0"],
    }[command]
    for content in (None, "# only a comment\n"):
        keys = tmp_path / "keys"
        if content is not None:
            keys.write_text(content)
        out = subprocess.run(
            [*OMNI, *args],
            env={"OMNI_API_KEYS_FILE": str(keys), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr[-2000:]
        assert out.stderr.startswith("omni: OMNI_API_KEYS_FILE=")
