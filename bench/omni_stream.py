"""One streamed chat completion with text and audio, measured as vLLM-Omni measures it (its
`openai-chat-omni` benchmark client, `vllm bench serve --omni`), from the chunks' `modality`:

- ttft: from sending the request to the first text token;
- tpot: from the first text token to the last, over the tokens after the first (the reply's
  `completion_tokens`, from the usage the stream carries);
- audio_ttfp: to the first audio chunk;
- audio_rtf: to the last audio chunk, over the seconds of audio the response carried;
- e2e: to the end of the response (for throughput, requests completed per second).

Audio in either shape the gateway streams: OpenAI's PCM16 `delta.audio`, or vLLM-Omni's WAV
file per chunk in `delta.content`. aiohttp, as vLLM-Omni's client uses (and cheaper than httpx
on a CPU the gateway shares).
"""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

SAMPLE_RATE = 24000


def _samples(delta: dict[str, Any]) -> int:
    """The audio samples of one audio chunk's delta."""
    if data := (delta.get("audio") or {}).get("data"):
        return len(base64.b64decode(data)) // 2  # PCM16 (asked for as pcm16: no WAV header)
    if content := delta.get("content"):
        with wave.open(io.BytesIO(base64.b64decode(content))) as w:
            return w.getnframes()
    return 0


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """SSE lines of any length (aiohttp's own line reader stops at 64 KiB)."""
    pending = b""
    async for data in content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line


async def streamed(session: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> dict[str, float]:
    """POST `body` (a streamed chat completion) to the gateway at `base` and measure it."""
    ttft = ttfp = last_audio = last_text = None
    samples = tokens = 0
    t = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {(await r.read())[:500]!r}")
        async for line in _lines(r.content):
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter() - t
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            tokens = max(tokens, int((chunk.get("usage") or {}).get("completion_tokens") or 0))
            if chunk.get("modality") == "audio":
                ttfp = now if ttfp is None else ttfp
                last_audio = now
                samples += _samples(delta)
            elif delta.get("content"):
                ttft = now if ttft is None else ttft
                last_text = now
    end = time.perf_counter() - t
    if ttfp is None or last_audio is None or not samples:
        raise RuntimeError("the response carried no audio")
    audio_s = samples / SAMPLE_RATE
    rtf = last_audio / audio_s
    tpot = (
        (last_text - ttft) / (tokens - 1)
        if ttft is not None and last_text is not None and tokens > 1
        else 0.0
    )
    return {
        "ttft": ttft or 0.0,
        "tpot": tpot,
        "audio_ttfp": ttfp,
        "audio_rtf": rtf,
        "audio_s": audio_s,
        "e2e": end,
    }
