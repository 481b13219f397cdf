"""The last hidden state of every position vLLM computes, from its worker to the stage.

Qwen2.5-Omni's talker reads, per token, the thinker's last (normed) hidden state of the
position that consumed it; vLLM returns tokens, never hidden states. vLLM's model runner holds
them between its forward and its sampling (`execute_model_state`), one row per scheduled
token, requests in its input batch's order. Our worker class (`worker.py`, vLLM's
`worker_cls`) reads them there on each step and pushes each request's rows, with the position
of the first, over a ZeroMQ socket to the stage process, which waits on them here
(`HiddenStates`). Only the first tensor-parallel rank of the last pipeline stage sends.

Frames: `[HiddenRows (msgpack), float32 rows (raw bytes)]`. Nothing is unpickled. Rows of a
request the stage is not waiting on are dropped; a request's store is freed when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Final

import msgspec
import torch

log = logging.getLogger(__name__)

ADDRESS_ENV: Final = "OMNI_VLLM_HIDDEN_STATES"
"""The ZeroMQ address vLLM's workers push to, set by the stage before vLLM starts them."""
_SUFFIX: Final = 9
"""vLLM names a request `<our id>-<8 characters>` inside its engine."""


class HiddenRows(msgspec.Struct, frozen=True):
    """`rows` hidden states of one request, for positions `start` .. `start + rows - 1`."""

    request: str
    start: int
    rows: int
    width: int


@dataclass
class _Request:
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class HiddenStates:
    """The stage's end: a PULL socket, and per request (by our vLLM request id) the rows so
    far, until the request ends (`done`)."""

    def __init__(self) -> None:
        import zmq
        import zmq.asyncio

        name = f"omni-vllm-hidden-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Linux: an abstract socket, which no file names, so a killed stage leaves nothing behind.
        self._path = None if sys.platform == "linux" else os.path.join(tempfile.gettempdir(), name)
        self.address = f"ipc://@{name}" if self._path is None else f"ipc://{self._path}"
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.bind(self.address)
        self._requests: dict[str, _Request] = {}
        self._decoder = msgspec.msgpack.Decoder(HiddenRows)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive(), name="vllm-hidden-states")

    def expect(self, request: str) -> None:
        """Keep what arrives for `request` from now on."""
        self._requests[request] = _Request()

    def done(self, request: str) -> None:
        self._requests.pop(request, None)

    def held(self) -> int:
        """Requests whose rows are kept now."""
        return len(self._requests)

    async def rows(self, request: str, start: int, stop: int, timeout: float) -> torch.Tensor:
        """Positions `start` .. `stop - 1`, [stop - start, width], once all have arrived."""
        r = self._requests[request]
        async with asyncio.timeout(timeout):
            while not all(p in r.rows for p in range(start, stop)):
                r.arrived.clear()
                await r.arrived.wait()
        return torch.stack([r.rows.pop(p) for p in range(start, stop)])

    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                head, body = frames
                msg = self._decoder.decode(head.buffer)
                r = self._requests.get(msg.request[:-_SUFFIX])
                if r is None:
                    continue
                rows = torch.frombuffer(bytearray(body.buffer), dtype=torch.float32).view(msg.rows, msg.width)
            except (ValueError, RuntimeError, msgspec.DecodeError) as exc:  # its request waits out
                log.warning("vLLM hidden states: a message that does not decode (%s)", exc)
                continue
            for i in range(msg.rows):
                r.rows[msg.start + i] = rows[i]
            r.arrived.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close(linger=0)
        self._ctx.term()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
