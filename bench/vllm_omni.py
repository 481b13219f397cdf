"""vllm-omni: the tiny demo (examples/tiny-omni.yaml) measured by `omni bench`'s client and by
vLLM-Omni's own CLI, `vllm bench serve --omni --backend openai-chat-omni` (its console entry
point, from its own virtualenv), one after the other in one run, at concurrency 1 and 4: TTFT,
TPOT, audio TTFP and audio RTF by vLLM-Omni's definitions (bench.omni_stream), each tool's
median over its requests.

Each request asks for text and audio as vLLM-Omni's clients do (no `audio` object: the default
voice, a WAV file per audio chunk; continuous usage), TOKENS thinker tokens with `ignore_eos`,
ROUNDS requests per tool and concurrency. Their CLI sends its random dataset's 16-token prompts;
ours a short sentence (both tiny next to the reply).

Ratios, ours over theirs (1.0: they measure alike), at each concurrency:
- ttft_c1, tpot_c1, ttfp_c1, rtf_c1, and the same at c4.

vLLM-Omni runs from .venv-vllm-omni (`make vllm-omni-venv`): it pins a vLLM other than ours.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import bars, figure, machine, median, parser, report, rounds, warmed
from bench.load import chat
from bench.omni_stream import streamed
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
VLLM_OMNI_PYTHON = ROOT / ".venv-vllm-omni" / "bin" / "python"
"""vLLM-Omni 0.30 in a virtualenv of its own (`make vllm-omni-venv`; `make test` builds it)."""
ROUNDS = 32
TOKENS = 64
CONCURRENCY = (1, 4)


def vllm_omni_client(
    base: str, model: str, requests: int, max_tokens: int, extras: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """What vLLM-Omni's benchmark request function measured of `requests` chat completions
    against the gateway at `base` with each extra body of `extras` (default: one run, none),
    and the warnings it logged in each run; one process for all (scripts/vllm_omni_client.py)."""
    if not VLLM_OMNI_PYTHON.exists():
        raise FileNotFoundError(f"{VLLM_OMNI_PYTHON} is missing: `make vllm-omni-venv` builds it")
    argv = [str(VLLM_OMNI_PYTHON), str(ROOT / "scripts" / "vllm_omni_client.py"), base, model]
    argv += [str(requests), str(max_tokens), *(json.dumps(e) for e in extras or [{}])]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours would shadow its vLLM
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM-Omni's client failed: {done.stderr[-3000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


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


async def ours(base: str, tokens: int, requests: int, concurrency: int) -> list[dict[str, float]]:
    """`requests` streamed requests, `concurrency` at a time, each measured by bench.omni_stream."""
    body = chat(
        "Tell me a story.",
        stream=True,
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        modalities=["text", "audio"],
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # as theirs asks
    )
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one() -> dict[str, float]:
            async with gate:
                return await streamed(session, base, body)

        return list(await asyncio.gather(*(one() for _ in range(requests))))


def ours_summary(measured: list[dict[str, float]]) -> dict[str, float]:
    of = lambda k: median([m[k] for m in measured])  # noqa: E731
    return {
        "ttft_ms": of("ttft") * 1000,
        "tpot_ms": of("tpot") * 1000,
        "ttfp_ms": of("audio_ttfp") * 1000,
        "rtf": of("audio_rtf"),
    }


def theirs_summary(result: dict[str, Any]) -> dict[str, float]:
    """The medians its CLI reports (robuster than its means, at 4 requests at a time, on 2 cores)."""
    return {
        "ttft_ms": result["median_ttft_ms"],
        "tpot_ms": result["median_tpot_ms"],
        "ttfp_ms": result["median_audio_ttfp_ms"],
        "rtf": result["median_audio_rtf"],
    }


def shown(summary: dict[str, float]) -> dict[str, float]:
    """Rounded for the table; ratios are taken before rounding (a client that read a few
    chunks together measures a TPOT of microseconds, which rounds to 0)."""
    return {k: round(v, 3 if k == "rtf" else 2) for k, v in summary.items()}


def plot(result: dict[str, Any], path: Any) -> None:
    fig, (a, b) = figure(2)
    runs = result["runs"]
    labels = ["TTFT", "TPOT", "TTFP"]
    bars(a, labels, {k: [r["ttft_ms"], r["tpot_ms"], r["ttfp_ms"]] for k, r in runs.items()}, "ms", "by tool")
    bars(b, ["RTF"], {k: [r["rtf"]] for k, r in runs.items()}, "RTF", "by tool")
    from bench.common import save

    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    n = rounds(ROUNDS, args)
    tokens = 16 if args.quick else TOKENS
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-omni.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    runs: dict[str, dict[str, float]] = {}
    with demo_models() as cwd, served("bench", spec, cwd=cwd) as base, tempfile.TemporaryDirectory() as tmp:
        if warmed(args):
            asyncio.run(ours(base, tokens, 2, 1))
        for c in CONCURRENCY:
            runs[f"omni_bench_c{c}"] = ours_summary(asyncio.run(ours(base, tokens, n, c)))
            got = vllm_bench_serve(
                base,
                "bench",
                Path(cwd) / "models" / "tiny-thinker",
                Path(tmp),
                prompts=n,
                concurrency=c,
                tokens=tokens,
            )
            if got["failed"]:
                raise RuntimeError(
                    f"vLLM-Omni's CLI failed {got['failed']} requests: {got.get('errors', [])[:3]}"
                )
            runs[f"vllm_omni_c{c}"] = theirs_summary(got)
    ratios = {
        f"{m}_c{c}": round(runs[f"omni_bench_c{c}"][k] / runs[f"vllm_omni_c{c}"][k], 3)
        for c in CONCURRENCY
        for m, k in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("ttfp", "ttfp_ms"), ("rtf", "rtf"))
    }
    runs = {name: shown(r) for name, r in runs.items()}
    result = {"benchmark": "vllm-omni", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [(name, "  ".join(f"{k} {v}" for k, v in r.items())) for name, r in runs.items()]
    rows += [(k, str(v)) for k, v in ratios.items()]
    report("vllm_omni", rows, result, args, plot)


if __name__ == "__main__":
    main()
