"""vLLM-Omni's own benchmark client against a gateway: its `openai-chat-omni` request function
(`vllm_omni.benchmarks.patch.patch`, what `vllm bench serve --omni --backend openai-chat-omni`
sends and measures with), run as it ships. It runs in its own virtualenv (.venv-vllm-omni:
vLLM-Omni 0.30 does not import beside our vLLM), so this file imports nothing of ours.

    python scripts/vllm_omni_client.py BASE_URL MODEL REQUESTS MAX_TOKENS [EXTRA_BODY_JSON ...]

For each EXTRA_BODY_JSON (none: one run, adding nothing), sends REQUESTS chat completions one
after another, asking for text and audio as vLLM-Omni's benchmark does (`--extra-body
'{"modalities": ["text", "audio"]}'`, and what EXTRA_BODY_JSON adds). Prints a JSON list, an
object per run: each request's success, error, ttft, audio_ttfp, audio_rtf, audio_duration,
text and output_tokens, and every warning vLLM-Omni's or vLLM's loggers gave during the run (a
chunk it could not parse). Several runs share one process: importing vLLM costs 12 s of CPU.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any


class Warnings(logging.Handler):
    """Every warning or error logged, once (it is attached where vLLM's loggers stop propagating)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not any(r is record for r in self.records):
            self.records.append(record)


async def run(base: str, model: str, requests: int, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput
    from vllm_omni.benchmarks.patch.patch import async_request_openai_chat_omni_completions

    outputs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for i in range(requests):
            rfi = RequestFuncInput(
                prompt=f"Tell me a story, number {i}.",
                api_url=f"{base}/v1/chat/completions",
                prompt_len=0,
                output_len=max_tokens,
                model=model,
                extra_body={"modalities": ["text", "audio"], **extra},
            )
            out = await async_request_openai_chat_omni_completions(rfi, session)
            outputs.append(
                {
                    k: getattr(out, k)
                    for k in (
                        "success",
                        "error",
                        "ttft",
                        "audio_ttfp",
                        "audio_rtf",
                        "audio_duration",
                        "generated_text",
                        "output_tokens",
                        "latency",
                    )
                }
            )
    return {"requests": outputs}


def main() -> None:
    base, model, requests, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    extras = [json.loads(a) for a in sys.argv[5:]] or [{}]
    import vllm_omni.benchmarks.patch.patch  # noqa: F401  (its import configures the loggers)

    warnings = Warnings()
    for name in ("", "vllm", "vllm_omni"):
        logging.getLogger(name).addHandler(warnings)
    runs = []
    for extra in extras:
        seen = len(warnings.records)
        result = asyncio.run(run(base, model, requests, max_tokens, extra))
        runs.append({**result, "warnings": [r.getMessage() for r in warnings.records[seen:]]})
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
