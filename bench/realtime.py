"""realtime: live sessions (WS /v1/realtime) on Qwen2.5-Omni (examples/qwen2.5-omni.yaml, the tiny
checkpoint, this CPU), measured as a voice client feels them.

Each turn is a user's audio (a tone in noise, 24 kHz PCM16) appended in 100 ms pieces as it
is spoken, PACE times as fast (one every 25 ms; --quick sends them at once), and committed by hand
(turn_detection null), then `response.create` for a short spoken answer (THINKER_TOKENS
tokens, voice Ethan). First audio is the time from the commit (the end of speech) to the first
`response.output_audio.delta`.

Ratios, each against a baseline measured in the same run, of medians over ROUNDS samples: one
first audio varies by 10-20% from the next on this 2-core machine (the stages, the gateway and
the client share its cores), so five samples let a ratio swing by a third from run to run.
Played faster than spoken so that a run holds four times the samples: what encoding ahead
saves needs only the pipeline to keep up with the audio as it comes (the tiny audio tower
encodes a 2 s window in a few ms), and what is measured starts at the end of speech.
- first_audio_10s_vs_2s: median first audio after a 10 s utterance over after a 2 s one, each on
  a fresh session, taken in turn (2 s, 10 s, 2 s, ...: what drifts in a run weighs on both)
  (issue 38's goal <= 1.3: little work left at the end of speech, the audio encoded as it
  arrived); and, in a full run, the same with the thinker's `audioAhead: false`
  (first_audio_10s_vs_2s_not_ahead: all of it encoded at the commit).
- first_audio_turn5_vs_turn1: median first audio at the fifth turn of a session over the first
  (2 s utterances; goal <= 1.3: the conversation's earlier turns are not prefilled again).
And, as figures: every sample (`*_each_ms`), each turn's prompt tokens and those the thinker
reused of the turn before (`prompt_cache_key`: the session's own), and cancel_ms, from
`response.cancel` to `response.done` (`cancelled`) for a response cancelled at its first audio.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from websockets.asyncio.client import ClientConnection, connect

from bench.common import bars, figure, machine, median, parser, report, rounds
from bench.procs import demo_models, served

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 40
PACE = 4.0
"""The microphone played this many times as fast as it was spoken."""
THINKER_TOKENS = 30
TURNS = 5
PIECE = 4800  # bytes: 100 ms of 24 kHz PCM16


def pipeline() -> dict[str, Any]:
    spec = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "qwen2.5-omni.yaml").read_text())["spec"])
    spec["servedModelName"] = "bench"
    return spec


def utterance(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(24000 * seconds)) / 24000
    clip = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    return (clip * 32767).astype("<i2").tobytes()


async def session(base: str) -> ClientConnection:
    ws = await connect(f"{base.replace('http://', 'ws://')}/v1/realtime?model=bench", max_size=None)
    await _until(ws, "session.created")
    manual = {"audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}}}
    await ws.send(json.dumps({"type": "session.update", "session": manual}))
    await _until(ws, "session.updated")
    return ws


async def _until(ws: ClientConnection, kind: str) -> dict[str, Any]:
    while (event := json.loads(await ws.recv()))["type"] != kind:
        if event["type"] == "error":
            raise RuntimeError(event["error"]["message"])
    return event


async def turn(ws: ClientConnection, pcm: bytes, paced: bool, cancel: bool = False) -> dict[str, float]:
    """One spoken turn: first audio after the commit, in ms (and, cancelling at the first audio,
    how long the cancel took). `paced`: each piece when it has been spoken (PACE times as fast),
    as a microphone's."""
    start = time.perf_counter()
    for at in range(0, len(pcm), PIECE):
        if paced:
            await asyncio.sleep(max(0.0, start + at / (2 * 24000 * PACE) - time.perf_counter()))
        piece = base64.b64encode(pcm[at : at + PIECE]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
    t0 = time.perf_counter()
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    tokens = 1000 if cancel else THINKER_TOKENS
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": tokens}}))
    await _until(ws, "response.output_audio.delta")
    figures = {"first_audio_ms": (time.perf_counter() - t0) * 1000}
    if cancel:
        t1 = time.perf_counter()
        await ws.send(json.dumps({"type": "response.cancel"}))
        done = await _until(ws, "response.done")
        assert done["response"]["status"] == "cancelled", done["response"]["status"]
        figures["cancel_ms"] = (time.perf_counter() - t1) * 1000
    else:
        usage = (await _until(ws, "response.done"))["response"]["usage"]
        figures |= {
            "input_tokens": usage["input_tokens"],
            "cached_tokens": usage["input_token_details"]["cached_tokens"],
        }
    return figures


async def first_audio(base: str, seconds: float, seed: int, paced: bool) -> float:
    """First audio after one utterance, the first turn of a fresh session."""
    ws = await session(base)
    try:
        return (await turn(ws, utterance(seconds, seed), paced))["first_audio_ms"]
    finally:
        await ws.close()


async def by_turn(base: str, n: int, paced: bool) -> dict[str, Any]:
    """Over n sessions of TURNS turns (2 s each): the median first audio at each turn, each
    turn's samples, and each turn's prompt: `cached/input` tokens (what the thinker reused of
    the turn before, of what the prompt holds)."""
    per_turn: list[list[float]] = [[] for _ in range(TURNS)]
    prompts = [""] * TURNS
    for _ in range(n):
        ws = await session(base)
        for t in range(TURNS):
            figures = await turn(ws, utterance(2.0, t), paced)
            per_turn[t].append(figures["first_audio_ms"])
            prompts[t] = f"{figures['cached_tokens']:.0f}/{figures['input_tokens']:.0f}"
        await ws.close()
    return {
        "first_audio_by_turn_ms": [round(median(xs), 1) for xs in per_turn],
        "first_audio_by_turn_each_ms": [[round(x, 1) for x in xs] for xs in per_turn],
        "cached_of_input_tokens_by_turn": prompts,
    }


async def cancels(base: str, n: int) -> float:
    ws = await session(base)
    took = [(await turn(ws, utterance(2.0, i), False, cancel=True))["cancel_ms"] for i in range(n)]
    await ws.close()
    return round(median(took), 1)


def plot(result: dict[str, Any], path: Any) -> None:
    runs = result["runs"]
    fig, (by_len, by_t) = figure(2)
    series = {"audio encoded as it arrives": [runs["first_audio_2s_ms"], runs["first_audio_10s_ms"]]}
    if "first_audio_10s_not_ahead_ms" in runs:
        series["all of it at the commit"] = [
            runs["first_audio_2s_not_ahead_ms"],
            runs["first_audio_10s_not_ahead_ms"],
        ]
    bars(by_len, ["2 s", "10 s"], series, "ms")
    by_len.set_title("End of speech to first audio, by utterance")
    turns = [f"turn {i + 1}" for i in range(TURNS)]
    bars(by_t, turns, {"first audio": runs["first_audio_by_turn_ms"]}, "ms")
    by_t.set_title("End of speech to first audio, by turn (2 s each)")
    from bench.common import save

    save(fig, path)


def not_ahead() -> dict[str, Any]:
    """The pipeline with its thinker encoding no audio ahead: all of a turn at its commit."""
    spec = pipeline()
    thinker = next(s for s in spec["stages"] if s["name"] == "thinker")
    thinker["engine"]["args"]["audioAhead"] = False
    return spec


async def by_lengths(base: str, n: int, paced: bool) -> dict[str, Any]:
    """Medians of n first audios after a 2 s and after a 10 s utterance, taken in turn (2 s,
    10 s, 2 s, ...) so that whatever drifts during the run (the machine's other work, the
    allocators' growth) weighs on both alike; each one's samples besides, to see the spread."""
    await first_audio(base, 2.0, 0, False)  # warm: the first request sets up what every later one uses
    firsts: dict[float, list[float]] = {2.0: [], 10.0: []}
    for i in range(n):
        for seconds in firsts:
            firsts[seconds].append(await first_audio(base, seconds, i, paced))
    figures: dict[str, Any] = {}
    for seconds, xs in firsts.items():
        figures[f"first_audio_{seconds:.0f}s_ms"] = round(median(xs), 1)
        figures[f"first_audio_{seconds:.0f}s_each_ms"] = [round(x, 1) for x in xs]
    return figures


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    n = rounds(ROUNDS, args)
    paced = not args.quick
    with demo_models() as cwd:
        with served("bench", pipeline(), cwd=cwd) as base:

            async def measure() -> dict[str, Any]:
                return {
                    **await by_lengths(base, n, paced),
                    **await by_turn(base, n, paced),
                    "cancel_ms": await cancels(base, n),
                }

            runs = asyncio.run(measure())
        if not args.quick:
            with served("bench", not_ahead(), cwd=cwd) as base:
                off = asyncio.run(by_lengths(base, n, paced))
            runs |= {f"{k.removesuffix('_ms')}_not_ahead_ms": v for k, v in off.items()}
    by = runs["first_audio_by_turn_ms"]
    ratios = {
        "first_audio_10s_vs_2s": round(runs["first_audio_10s_ms"] / runs["first_audio_2s_ms"], 3),
        "first_audio_turn5_vs_turn1": round(by[-1] / by[0], 3),
    }
    if "first_audio_10s_not_ahead_ms" in runs:
        ratios["first_audio_10s_vs_2s_not_ahead"] = round(
            runs["first_audio_10s_not_ahead_ms"] / runs["first_audio_2s_not_ahead_ms"], 3
        )
    result = {"benchmark": "realtime", "machine": machine(), "runs": runs, "ratios": ratios}
    rows = [(k, str(v)) for k, v in runs.items()] + [(k, str(v)) for k, v in result["ratios"].items()]
    report("realtime", rows, result, args, plot)


if __name__ == "__main__":
    main()
