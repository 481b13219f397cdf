"""The pipeline API every front end calls: check a request once, run it, give back its events.

HTTP routes (and live sessions and jobs alike) hand a `PipelineRequest` to `Pipeline.prepare`,
which does every pre-flight check in one place (the model and the outputs it makes, the
parameters the source stages honour, the voice, the media parts the model reads, and media
decoding within the gateway's limits), then `Pipeline.run` with what it returned. `run` owns
routing, attempts, migration and freeing: a request whose route loses a replica (dead,
silent, restarted) or whose replica refuses it (draining, full, unhealthy) runs again on a
fresh route, up to migrationLimit times, within its deadline; closing the iterator aborts it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Final

import msgspec
import nats.errors
import torch
from nats.aio.client import Client as NatsClient

from omni_gateway.attempt import Attempts
from omni_gateway.bus import RETRY_AFTER, Bus
from omni_gateway.choices import run_choices
from omni_gateway.cloning import CLIP, CODES, X_VECTOR, clone_voice
from omni_gateway.errors import OmniError, Overloaded
from omni_gateway.events import Event, OfChoice
from omni_gateway.media import decode_clip, decode_media
from omni_gateway.pins import ConversationPins
from omni_gateway.preflight import Announced, check_request
from omni_gateway.replay import Delivered, Diverged
from omni_gateway.request import PipelineRequest, Prepared
from omni_gateway.sleep import sleep, wake
from omni_gateway.tokens import tokenize
from omni_pipeline.connectors import build_connectors
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import (
    AudioInMsg,
    DetokenizeMsg,
    ErrorCode,
    ForgetPromptMsg,
    Subjects,
    TokenizeMsg,
    TokenizeReply,
    pack,
)
from omni_pipeline.spec import REQUEST_SOURCE, PipelineFile
from omni_pipeline.voices import VoicePrint

log = logging.getLogger("omni.gateway")

MIGRATABLE: Final = frozenset(
    {
        ErrorCode.REPLICA_LOST,
        ErrorCode.DRAINING,
        ErrorCode.FULL,
        ErrorCode.UNHEALTHY,
        ErrorCode.SLEEPING,
        ErrorCode.NATS_LOST,
    }
)
"""Errors that say where a request went, not what it is: a fresh route may well serve it (after
a NATS outage, the re-run waits for the server)."""


class Pipeline:
    """This gateway's way into the pipeline."""

    def __init__(self, pipeline: PipelineFile, nats_url: str, gateway_id: str | None = None) -> None:
        self.spec = pipeline.spec
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.started_at = int(time.time())
        self.payloads = OffLoop("gateway", build_connectors(self.spec, pipeline.name))
        self._bus = Bus(self.spec, Subjects(pipeline.name), self.gateway_id, nats_url, self.payloads)
        self._pins = ConversationPins()
        self._attempts = Attempts(self.spec, self._bus, self.payloads, pins=self._pins)
        self.announced = Announced(self.spec, self._bus.table)
        """What the replicas announced, as the pre-flight checks read it."""
        self.migrations: collections.Counter[str] = collections.Counter()
        """Re-runs on a fresh route: `moved` (nothing sent yet), `spliced` (a stream continued),
        `diverged` (a stream's re-run did not repeat it: failed)."""

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        return await self._bus.start(stop)

    async def stop(self) -> None:
        await self._bus.stop()
        self.payloads.close()

    # --- what the front ends ask of the pipeline as a whole -----------------------------------

    def ready(self) -> bool:
        """Connected, and every stage has a replica serving (or asleep, as it was told)."""
        return self._bus.ready()

    async def covered(self) -> None:
        """Returns once every stage has a replica serving."""
        await self._bus.covered.wait()

    def requests_in_flight(self) -> int:
        return len(self._bus.inflight)

    @property
    def nats(self) -> NatsClient | None:
        """This gateway's NATS connection (a JetStream store's, the resource metrics'); None
        before it first connected."""
        return self._bus.nc

    def free_at_entry(self) -> int:
        """Requests the stages that read a client's request could start at once: the fewest free
        slots among them (omni_gateway.batches holds its lines to it)."""
        entry = [s.name for s in self.spec.stages if any(e.from_ == REQUEST_SOURCE for e in s.inputs)]
        return min((self._bus.table.free(s) for s in entry), default=0)

    def replicas(self) -> list[dict[str, Any]]:
        """The live replica table this gateway routes by."""
        return self._bus.table.snapshot()

    async def sleep(self, stages: list[str], level: int, mode: str) -> dict[str, Any]:
        return await sleep(self._bus, stages, level, mode)

    async def wake(self, stages: list[str]) -> dict[str, Any]:
        return await wake(self._bus, stages)

    # --- conversations ------------------------------------------------------------------------

    async def forget_conversation(self, key: str) -> None:
        """A conversation ended (its live session closed): its pin goes, and every replica gives
        up the sequence it kept for it (one that misses the word gives it up when it idles out)."""
        self._pins.forget(key)
        if self._bus.nc is not None and self._bus.connected:
            with contextlib.suppress(nats.errors.Error):
                await self._bus.nc.publish(self._bus.subjects.control, pack(ForgetPromptMsg(key)))

    async def audio_in(self, key: str, start: int, pcm: bytes, rate: int) -> None:
        """A piece of a live session's audio, sent ahead to the replica of the stage that reads
        the request's media and encodes audio as it arrives, to which the session is pinned
        for its response (docs/realtime.md); nothing where no stage does. From sample `start`
        of the turn: 0 begins one. Best effort: a piece not sent is encoded at the response."""
        table = self._bus.table
        stage = next(
            (s for s in self._attempts.with_media() if table.encodes_audio_ahead(s)),
            None,
        )
        if stage is None or self._bus.nc is None or not self._bus.connected:
            return
        replica = table.choose(stage, self._pins.route(key).get(stage))
        if replica is None:
            return
        self._pins.pin(key, stage, replica.hb.instance)
        subject = self._bus.subjects.stage_inbox(stage, replica.hb.replica)
        with contextlib.suppress(nats.errors.Error):
            await self._bus.nc.publish(subject, pack(AudioInMsg(key, start, pcm, rate)))

    # --- pre-flight ---------------------------------------------------------------------------

    async def prepare(self, req: PipelineRequest) -> Prepared:
        """Every check a request passes before it runs (omni_gateway.preflight), and its media
        decoded; a 400 (or 404) names the field at fault."""
        check_request(self.announced, req)
        inputs, media = req.inputs, dict(req.media)
        if inputs.messages is not None:
            accepts = self.announced.by_sources(req.outputs, "accepts")
            messages, decoded = await decode_media(inputs.messages, self.spec.gateway.media, accepts)
            inputs, media = msgspec.structs.replace(inputs, messages=messages), decoded.tensors
        if req.ref_audio is not None:
            media[CLIP], rate = await decode_clip(req.ref_audio, self.spec.gateway.media)
            inputs = msgspec.structs.replace(inputs, ref_audio={"media": CLIP, "sample_rate": rate})
        if req.voice_print is not None:
            x_vector, codes = req.voice_print.tensors()
            media[X_VECTOR], kept = x_vector, {"x_vector": X_VECTOR}
            if codes is not None:
                media[CODES], kept["codes"] = codes, CODES
            inputs = msgspec.structs.replace(inputs, voice_print=kept)
        return Prepared(inputs, req.sampling, req.outputs, media, dict(req.per_stage), req.priority)

    async def clone_voice(self, pcm: torch.Tensor, rate: int, ref_text: str | None) -> VoicePrint:
        """The print of a clip's voice, taken by the stage that clones (omni_gateway.cloning)."""
        return await clone_voice(self._bus, self.payloads, self.announced, pcm, rate, ref_text)

    def voices(self) -> frozenset[str] | None:
        """The voices this pipeline speaks in; None while a stage that speaks has not said."""
        return self.announced.voices()

    # --- tokens ------------------------------------------------------------------------------

    async def tokenize(self, msg: TokenizeMsg | DetokenizeMsg) -> TokenizeReply:
        """Tokenize or detokenize as the first source stage reads a prompt (omni_gateway.tokens)."""
        return await tokenize(self._bus, self.announced, msg)

    # --- running -----------------------------------------------------------------------------

    async def run(
        self, rid: str, req: Prepared, *, whole: bool = False, timeout_s: float | None = None
    ) -> AsyncIterator[Event]:
        """Run one request; yields its events as they arrive. Closing the iterator aborts it.

        Nothing the caller has is sent twice: with `whole` (the caller sends nothing to its
        client before the end) the events are held until the request completes; otherwise a
        re-run's events are spliced on after what was already yielded (omni_gateway.replay),
        and a re-run that does not repeat it fails the request with the error that made it move.
        `timeout_s`: its deadline, if not the gateway's `requestTimeoutS` (a video job's).
        """
        deadline = time.monotonic() + (timeout_s or self.spec.gateway.request_timeout_s)
        limit = self.spec.gateway.migration_limit
        delivered = Delivered()
        moved_by: OmniError | None = None
        for attempt in range(limit + 1):
            held: list[Event] = []
            try:
                splice = delivered.splice() if delivered.anything else None
                arid = rid if attempt == 0 else f"{rid}-{attempt}"
                async with contextlib.aclosing(self._attempts.run(arid, deadline, req)) as events:
                    async for ev in events:
                        if splice is not None and (ev := splice(ev)) is None:
                            continue
                        if whole:
                            held.append(ev)
                            continue
                        delivered.record(ev)
                        yield ev
            except OmniError as exc:
                if exc.code not in MIGRATABLE or attempt == limit:
                    if exc.code == ErrorCode.FULL:
                        raise Overloaded(exc.message, headers=RETRY_AFTER) from None
                    raise
                moved_by = exc
                self.migrations["spliced" if delivered.anything else "moved"] += 1
                log.warning("gateway: request %s: %s; running it again on a fresh route", rid, exc.message)
                continue
            except Diverged as exc:
                assert moved_by is not None
                self.migrations["diverged"] += 1
                why = f"the stream cannot go on from a fresh route: {exc}"
                raise type(moved_by)(f"{moved_by.message}; {why}", code=moved_by.code) from None
            for ev in held:
                yield ev
            return

    def run_choices(self, rid: str, n: int, req: Prepared, *, whole: bool = False) -> AsyncIterator[OfChoice]:
        """`n` replies to one request, side by side (omni_gateway.choices); closing the iterator
        aborts them all."""
        return run_choices(lambda child_rid, child: self.run(child_rid, child, whole=whole), rid, n, req)
