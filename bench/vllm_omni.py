"""vllm-omni: the tiny demo (examples/tiny-omni.yaml) measured by `omni bench`'s client and by
vLLM-Omni's own benchmark client (its `openai-chat-omni` request function, behind `vllm bench
serve --omni`), the same requests in one run: TTFT, audio TTFP and audio RTF by vLLM-Omni's
definitions (bench.omni_stream), medians of each tool's requests, one at a time.

Each request asks for text and audio as vLLM-Omni's clients do (no `audio` object: the default
voice, a WAV file per audio chunk), 64 thinker tokens, ROUNDS by each tool in turn, one at a
time (each sends its own prompt: both are tiny next to the 64 tokens).

Ratios, each tool's median over the other's (1.0: they measure alike):
- ttft_ours_vs_vllm_omni, ttfp_ours_vs_vllm_omni, rtf_ours_vs_vllm_omni.

vLLM-Omni runs from .venv-vllm-omni (`make vllm-omni-venv`): it pins a vLLM other than ours.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import bars, figure, machine, median, parser, report, rounds
from bench.load import chat
from bench.omni_stream import streamed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
VLLM_OMNI_PYTHON = ROOT / ".venv-vllm-omni" / "bin" / "python"
"""vLLM-Omni 0.30 in a virtualenv of its own (`make vllm-omni-venv`; `make test` builds it)."""
ROUNDS = 20
TOKENS = 64


def vllm_omni_client(
    base: str, model: str, requests: int, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What vLLM-Omni's benchmark request function measured of `requests` chat completions
    against the gateway at `base`, and the warnings it logged (scripts/vllm_omni_client.py)."""
    if not VLLM_OMNI_PYTHON.exists():
        raise FileNotFoundError(f"{VLLM_OMNI_PYTHON} is missing: `make vllm-omni-venv` builds it")
    argv = [str(VLLM_OMNI_PYTHON), str(ROOT / "scripts" / "vllm_omni_client.py"), base, model]
    argv += [str(requests), str(max_tokens), json.dumps(extra or {})]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours would shadow its vLLM
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM-Omni's client failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


PERCENTILE_METRICS = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"


def vllm_bench_serve(
    base: str,
    model: str,
    tokenizer: Path,
    out_dir: Path,
    *,
    prompts: int,
    concurrency: int,
    tokens: int = 16,
) -> dict[str, Any]:
    """vLLM-Omni's CLI as its users run it: `vllm bench serve --omni --backend
    openai-chat-omni` (the console entry point of .venv-vllm-omni) against the gateway at
    `base`, on its random dataset, every request asking for text and audio and running to
    `tokens` (`--ignore-eos`). Returns the result file it saves (its detailed one: per-request
    errors included), with what it printed under `log`."""
    vllm = VLLM_OMNI_PYTHON.parent / "vllm"
    if not vllm.exists():
        raise FileNotFoundError(f"{vllm} is missing: `make vllm-omni-venv` builds it")
    argv = [
        str(vllm), "bench", "serve", "--omni", "--backend", "openai-chat-omni",
        "--base-url", base, "--endpoint", "/v1/chat/completions",
        "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(tokens),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--percentile-metrics", PERCENTILE_METRICS,
        "--extra-body", json.dumps({"modalities": ["text", "audio"]}),
        "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", "result.json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours would shadow its vLLM
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=out_dir)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {log[-3000:]}")
    return {**json.loads((out_dir / "result.json").read_text()), "log": log}


async def ours(base: str, tokens: int) -> dict[str, float]:
    body = chat(
        "Tell me a story.", stream=True, max_tokens=tokens, temperature=0.0, modalities=["text", "audio"]
    )
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}  # as theirs asks
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await streamed(session, base, body)


def summary(measured: list[dict[str, float]]) -> dict[str, float]:
    return {
        "ttft_ms": round(median([m["ttft"] for m in measured]) * 1000, 1),
        "ttfp_ms": round(median([m["audio_ttfp"] for m in measured]) * 1000, 1),
        "rtf": round(median([m["audio_rtf"] for m in measured]), 3),
    }


def plot(result: dict[str, Any], path: Any) -> None:
    fig, (a, b) = figure(2)
    runs = result["runs"]
    bars(a, ["TTFT", "TTFP"], {k: [runs[k]["ttft_ms"], runs[k]["ttfp_ms"]] for k in runs}, "ms", "by tool")
    bars(b, ["RTF"], {k: [runs[k]["rtf"]] for k in runs}, "RTF", "by tool")
    from bench.common import save

    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    n = rounds(ROUNDS, args)
    tokens = 16 if args.quick else TOKENS
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    with demo_models() as cwd, served("bench", spec, cwd=cwd) as base:
        asyncio.run(ours(base, tokens))  # warm-up
        mine = [asyncio.run(ours(base, tokens)) for _ in range(n)]
        got = vllm_omni_client(base, "bench", n, tokens)
    if got["warnings"]:
        raise RuntimeError(f"vLLM-Omni's client warned: {got['warnings'][:3]}")
    for r in got["requests"]:
        if not r["success"]:
            raise RuntimeError(f"vLLM-Omni's client failed a request: {r['error']}")
    theirs = [{k: r[k] for k in ("ttft", "audio_ttfp", "audio_rtf")} for r in got["requests"]]
    runs = {"omni_bench": summary(mine), "vllm_omni": summary(theirs)}
    result = {
        "benchmark": "vllm-omni",
        "machine": machine(),
        "runs": runs,
        "ratios": {
            f"{m}_ours_vs_vllm_omni": round(runs["omni_bench"][k] / runs["vllm_omni"][k], 3)
            for m, k in (("ttft", "ttft_ms"), ("ttfp", "ttfp_ms"), ("rtf", "rtf"))
        },
    }
    rows = [(name, "  ".join(f"{k} {v}" for k, v in r.items())) for name, r in runs.items()]
    rows += [(k, str(v)) for k, v in result["ratios"].items()]
    report("vllm_omni", rows, result, args, plot)


if __name__ == "__main__":
    main()
