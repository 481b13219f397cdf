"""vLLM-Omni's full-duplex client (`vllm_omni.clients.duplex.DuplexClient`, what its users drive
`/v1/realtime?duplex=1` with) against a gateway, through a TCP relay this script can cut, so that
the client's connection drops as a network drops it and the client resumes as it ships. It runs
in its own virtualenv (.venv-vllm-omni: vLLM-Omni 0.30 does not import beside our vLLM), so this
file imports nothing of ours.

    python scripts/vllm_omni_duplex_client.py WS_URL MODEL PCM_FILE RATE VOICE TOKENS LONG_TOKENS

PCM_FILE is a turn of speech, PCM16 mono at RATE. The session (the client's own SessionConfig:
input at RATE, VOICE, auto_response) talks:

1. the turn, streamed in 100 ms pieces and committed, answered in at most TOKENS; the answer's
   audio is taken as it comes, each chunk acknowledged as played (`ack_playback`), and at its
   first chunk the relay is cut: the client resumes the session on a new connection and the
   answer goes on;
2. the same turn again, answered in at most LONG_TOKENS; the first chunk is acknowledged, and
   at the second the client cuts in (`barge_in`);
3. `close()`.

Prints one JSON object: the session's capabilities, each answer (decision, transcript, audio
ms, status, what the server last acknowledged of its playback), every event's type and
`server_event_seq` in the order the client saw them, how often it resumed, and the errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any
from urllib.parse import urlsplit


class Relay:
    """A TCP relay to the gateway whose connections can all be cut at once."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.links: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.links += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.links:
            writer.transport.abort()
        self.links.clear()


async def answer(client: Any, at_chunk: int, act: Any) -> dict[str, Any]:
    """The next response: its audio taken as it comes, each chunk acknowledged as played, and
    `act(client, response, acked_ms)` done on chunk `at_chunk` (True: acknowledge no more)."""
    from vllm_omni.clients.duplex import DuplexConnectionError, DuplexProtocolError

    try:
        async for response in client.responses():
            audio, acked, acking = b"", 0.0, True
            async for chunk in response.audio():
                audio += chunk
                at_chunk -= 1
                if at_chunk == 0 and await act(client, response, acked):
                    acking = False
                if acking:
                    # Best effort while the connection is down: the next ack says as much.
                    with contextlib.suppress(DuplexConnectionError):
                        await client.ack_playback(response.played_ms, response_id=response.response_id)
                        acked = response.played_ms
            await response.wait(120)
            done = response.done_event.raw if response.done_event is not None else {}
            return {
                "response_id": response.response_id,
                "decision": response.decision,
                "transcript": response.transcript,
                "audio_ms": len(audio) * 1000 / (24000 * 2),
                "status": done.get("response", {}).get("status"),
            }
    except DuplexProtocolError as exc:
        return {"error": str(exc), "code": exc.code}
    return {"error": "the session ended"}


async def run(
    url: str, model: str, pcm: bytes, rate: int, voice: str, tokens: int, long_tokens: int
) -> dict[str, Any]:
    from vllm_omni.clients.duplex import AudioFormat, DuplexClient, ReconnectPolicy, SessionConfig

    parts = urlsplit(url)
    relay = Relay(parts.hostname or "127.0.0.1", parts.port or 80)
    port = await relay.start()
    config = SessionConfig(input_audio=AudioFormat("pcm16", rate), voice=voice)
    seen: list[dict[str, Any]] = []
    out: dict[str, Any] = {"events": seen}

    async def collect(client: Any) -> None:
        with contextlib.suppress(Exception):
            async for event in client.events():
                raw = event.raw
                seen.append({k: raw.get(k) for k in ("type", "server_event_seq", "event", "audio_end_ms")})

    async def cut(client: Any, response: Any, acked: float) -> bool:
        relay.cut()
        return False

    async def barge_in(client: Any, response: Any, acked: float) -> bool:
        out["acked_before_barge_in_ms"] = int(acked)
        await client.send({"type": "barge_in"})
        return True

    async def talk(max_tokens: int, at_chunk: int, act: Any) -> dict[str, Any]:
        await client.send({"type": "session.update", "session": {"max_output_tokens": max_tokens}})
        await client.wait_for("session.updated", timeout_s=30)
        await client.stream_pcm(pcm, chunk_ms=100, realtime=False)
        await client.commit()
        return await answer(client, at_chunk, act)

    relayed = url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{port}")
    reconnect = ReconnectPolicy(max_attempts=5, backoff_s=(0.1, 0.5))
    async with DuplexClient(relayed, model=model, config=config, reconnect=reconnect) as client:
        collector = asyncio.create_task(collect(client))
        out["session"] = client.session_info
        out["resumed"] = await talk(tokens, 1, cut)
        # Cut in at the second chunk, having acknowledged the first: more was sent than played.
        out["barged"] = await talk(long_tokens, 2, barge_in)
        await client.close()
        await asyncio.wait_for(collector, 30)
    return out


def main() -> None:
    url, model, pcm_file, rate, voice, tokens, long_tokens = sys.argv[1:8]
    with open(pcm_file, "rb") as f:
        pcm = f.read()
    print(json.dumps(asyncio.run(run(url, model, pcm, int(rate), voice, int(tokens), int(long_tokens)))))


if __name__ == "__main__":
    main()
