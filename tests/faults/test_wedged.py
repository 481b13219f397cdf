"""Fault 7: an engine whose forward never returns (a wedged kernel, a deadlock in a library),
in a replica that is otherwise alive: its event loop answers and its heartbeats go on, so
nothing outside it can tell. The replica watches its own engine: past stepTimeoutSeconds it
fails what it holds, as a lost replica (gateways run those requests elsewhere), and exits
non-zero at once (the wedged thread cannot be stopped), for its supervisor or kubelet to
start it afresh."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helpers import HTTP, ROOT, start_gateway, start_stage, wait_for


def wedging_pipeline(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "tests" / "data" / "synthetic.yaml").read_text())
    spec["metadata"]["name"] = "wedged"
    spec["spec"]["gateway"]["migrationLimit"] = 0  # one replica: the error, rather than a wait
    thinker = spec["spec"]["stages"][0]
    thinker["engine"]["args"]["hangOn"] = "WEDGE"
    thinker["stepTimeoutSeconds"] = 1
    path = tmp_path / "wedged.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_wedged_engine_fails_its_requests_and_exits(nats_url: str, tmp_path: Path) -> None:
    pipeline = wedging_pipeline(tmp_path)
    stages = {
        s: start_stage(pipeline, s, "a", nats_url, ROOT, tmp_path) for s in ("thinker", "talker", "vocoder")
    }
    gateway, base = start_gateway(pipeline, nats_url, ROOT, tmp_path)
    try:
        wait_for(lambda: HTTP.get(f"{base}/health").status_code == 200, 60, "the pipeline to be ready")
        body = {"model": "synth", "messages": [{"role": "user", "content": "WEDGE now"}]}
        r = HTTP.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert (
            "stage 'thinker' replica a lost its engine (wedged: a forward (or a prompt's build) has run for"
            in message
        )
        assert "over stepTimeoutSeconds (1s)" in message
        assert stages["thinker"].proc.wait(30) == 1  # gone, though a thread of it never returns
    finally:
        assert gateway.stop() == 0
        for name, p in stages.items():
            code = p.stop()
            assert name == "thinker" or code == 0, (name, code)
