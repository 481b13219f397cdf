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
from dataclasses import dataclass, field, replace
from typing import Final, Literal

import msgspec
import nats.errors
import torch

from omni_gateway.attempt import Attempts, Prepared
from omni_gateway.bus import RETRY_AFTER, Bus
from omni_gateway.errors import (
    BadRequest,
    ModelNotFound,
    NotServed,
    OmniError,
    Overloaded,
    StageFailed,
    Unavailable,
)
from omni_gateway.events import Event, OfChoice
from omni_gateway.inflight import EVENT_QUEUE
from omni_gateway.media import decode_media
from omni_gateway.replay import Delivered, Diverged
from omni_pipeline import wire
from omni_pipeline.clips import ClipError, check_size, clip_frames
from omni_pipeline.connectors import build_connectors
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import (
    AudioInMsg,
    DetokenizeMsg,
    ErrorCode,
    ForgetPromptMsg,
    RequestInputs,
    Subjects,
    TokenizeMsg,
    TokenizeReply,
    pack,
    unpack,
)
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind, PipelineFile

log = logging.getLogger("omni.gateway")

TOKENIZE_TIMEOUT_S: Final = 10.0
"""How long /tokenize waits for a stage (a long prompt through a chat template)."""

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


@dataclass(frozen=True)
class PipelineRequest:
    """A request as a front end hands it over, before any check."""

    model: str | None
    outputs: frozenset[OutputKind]
    inputs: RequestInputs
    sampling: Sampling
    outputs_param: str = "model"
    """The client's field that asked for the outputs (a 400 names it)."""
    voice_param: str | None = None
    """The client's field the voice came in (`sampling.voice`), to name in a 400."""
    max_tokens_param: str = "max_tokens"
    declared: frozenset[str] | None = None
    """The sampling parameters every source stage takes; any other must be one the source stages
    declare they honour. None: the endpoint's parameters are for stages downstream to take."""
    per_stage: dict[str, Sampling] = field(default_factory=dict)
    """Sampling asked of one stage alone (vLLM-Omni's `sampling_params_list`), by stage: each
    field one the stage declares it honours."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Media decoded by the front end (an edit's images), by the keys `inputs` refers to them
    with; a chat's come inside its messages and are decoded here."""


class Pipeline:
    """This gateway's way into the pipeline."""

    def __init__(self, pipeline: PipelineFile, nats_url: str, gateway_id: str | None = None) -> None:
        self.spec = pipeline.spec
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.started_at = int(time.time())
        self.payloads = OffLoop("gateway", build_connectors(self.spec, pipeline.name))
        self.bus = Bus(self.spec, Subjects(pipeline.name), self.gateway_id, nats_url, self.payloads)
        self.attempts = Attempts(self.spec, self.bus, self.payloads)
        self.migrations: collections.Counter[str] = collections.Counter()
        """Re-runs on a fresh route: `moved` (nothing sent yet), `spliced` (a stream continued),
        `diverged` (a stream's re-run did not repeat it: failed)."""

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        return await self.bus.start(stop)

    async def stop(self) -> None:
        await self.bus.stop()
        self.payloads.close()

    async def forget_conversation(self, key: str) -> None:
        """A conversation ended (its live session closed): its pin goes, and every replica gives
        up the sequence it kept for it (one that misses the word gives it up when it idles out)."""
        self.attempts.forget(key)
        if self.bus.nc is not None and self.bus.connected:
            with contextlib.suppress(nats.errors.Error):
                await self.bus.nc.publish(self.bus.subjects.control, pack(ForgetPromptMsg(key)))

    async def audio_in(self, key: str, start: int, pcm: bytes, rate: int) -> None:
        """A piece of a live session's audio, sent ahead to the replica of the stage that reads
        the request's media and encodes audio as it arrives, to which the session is pinned
        for its response (docs/realtime.md); nothing where no stage does. From sample `start`
        of the turn: 0 begins one. Best effort: a piece not sent is encoded at the response."""
        stage = next(
            (
                s
                for s in self.attempts.sources
                if s not in self.attempts.without_media and self.bus.table.encodes_audio_ahead(s)
            ),
            None,
        )
        if stage is None or self.bus.nc is None or not self.bus.connected:
            return
        replica = self.bus.table.choose(stage, self.attempts.pinned.get(key, {}).get(stage))
        if replica is None:
            return
        self.attempts.pin(key, stage, replica.hb.instance)
        subject = self.bus.subjects.stage_inbox(stage, replica.hb.replica)
        with contextlib.suppress(nats.errors.Error):
            await self.bus.nc.publish(subject, pack(AudioInMsg(key, start, pcm, rate)))

    # --- pre-flight --------------------------------------------------------------------------

    async def prepare(self, req: PipelineRequest) -> Prepared:
        """Every check a request passes before it runs, and its media decoded; a 400 (or 404)
        names the field at fault."""
        self._check_model(req.model, req.outputs, req.outputs_param)
        limit = self.spec.gateway.max_tokens
        if (asked := req.sampling.max_tokens) is not None and asked > limit:
            param = req.max_tokens_param
            raise BadRequest(f"{param}: {asked} is more than this model's limit of {limit}", param=param)
        if req.declared is not None:
            self._refuse_unhonoured(req.outputs, req.sampling.asked().keys(), req.declared)
        self._refuse_unhonoured_per_stage(req.outputs, req.per_stage)
        try:  # what the stages get must travel (a number past 64 bits, in a template's variables)
            wire.encode([req.sampling, req.per_stage])
        except wire.WireError as exc:
            raise BadRequest(f"the request's parameters cannot be sent on: {exc}") from None
        if OutputKind.AUDIO in req.outputs and req.voice_param is not None:
            self._refuse_unknown_voice(req.sampling.voice, req.voice_param)
        inputs, media = req.inputs, dict(req.media)
        if inputs.images:
            self._refuse_unless_editing(req.outputs)
        if inputs.messages is not None:
            accepts = self._sources_declare(req.outputs, "accepts")
            messages, decoded = await decode_media(inputs.messages, self.spec.gateway.media, accepts)
            inputs, media = msgspec.structs.replace(inputs, messages=messages), decoded.tensors
        return Prepared(inputs, req.sampling, req.outputs, media, dict(req.per_stage))

    def _refuse_unless_editing(self, outputs: frozenset[OutputKind]) -> None:
        """A 400 naming `image` for a pipeline whose source stages read no image (one that makes
        images from a prompt alone); the stage refuses it itself while they have not said."""
        accepts = self._sources_declare(outputs, "accepts")
        if accepts is not None and "image" not in accepts:
            raise BadRequest(
                f"image: model '{self.spec.served_model_name}' does not edit images; "
                f"it makes them from a prompt alone",
                param="image",
            )

    def _check_model(self, model: str | None, wanted: frozenset[OutputKind], param: str) -> None:
        """404 for another model's name; 400 for an output this pipeline does not make."""
        name = self.spec.served_model_name
        if model is not None and model != name:
            raise ModelNotFound(f"model '{model}' does not exist", param="model")
        offered = self.spec.output_kinds()
        if missing := wanted - offered:
            raise BadRequest(
                f"model '{name}' cannot output {', '.join(sorted(m.value for m in missing))}; "
                f"it outputs {', '.join(sorted(k.value for k in offered))}",
                param=param,
            )

    def _refuse_unhonoured(
        self, outputs: frozenset[OutputKind], params: collections.abc.KeysView[str], always: frozenset[str]
    ) -> None:
        """A 400 naming the first parameter (beyond the `always` ones) that a source stage on
        these outputs' route does not declare it honours; none while one has not declared."""
        honoured = self._sources_declare(outputs, "honours")
        if honoured is None:
            return
        for name in sorted(set(params) - always - honoured):
            stages = [s for s in self._sources(outputs) if name not in self._honours(s)]
            where = f"stage {', '.join(repr(s) for s in stages)} ({self._engine_kinds(stages)})"
            raise BadRequest(f"{name}: not honoured by {where}; leave it out", param=name)

    def _sources(self, outputs: frozenset[OutputKind]) -> list[str]:
        """The source stages on these outputs' route that decide what a request may ask (an
        encoder that runs only on media does not)."""
        return [
            s
            for s in self.spec.needed_stages(set(outputs))
            if s in self.attempts.sources and not self.spec.stage(s).skip_without_media
        ]

    def _honours(self, stage: str) -> frozenset[str]:
        declared = self.bus.table.declared(stage, "honours")
        return frozenset() if declared is None else declared

    def _engine_kinds(self, stages: list[str]) -> str:
        return ", ".join(sorted({self.spec.stage(s).engine.kind for s in stages}))

    def _refuse_unhonoured_per_stage(
        self, outputs: frozenset[OutputKind], per_stage: dict[str, Sampling]
    ) -> None:
        """A 400 for sampling asked of a stage this request does not run, or that the stage
        does not declare it honours (max_tokens every stage takes)."""
        order = [s.name for s in self.spec.stages]
        needed = self.spec.needed_stages(set(outputs))
        for stage, params in per_stage.items():
            param = f"sampling_params_list.{order.index(stage)}"
            if stage not in needed:
                raise BadRequest(
                    f"{param}: stage '{stage}' does not run for this request's outputs", param=param
                )
            honoured = self.bus.table.declared(stage, "honours")
            if honoured is None:
                continue
            for name in sorted(set(params.asked()) - {"max_tokens", "top_logprobs"} - honoured):
                engine = self._engine_kinds([stage])
                raise BadRequest(
                    f"{param}.{name}: not honoured by stage '{stage}' ({engine}); leave it out",
                    param=f"{param}.{name}",
                )

    def _refuse_unknown_voice(self, voice: str | None, param: str) -> None:
        """A 400 listing the voices, for a voice this pipeline does not speak in; none while
        they are not all declared (the stages refuse it themselves then)."""
        if voice is None or (voices := self.voices()) is None:
            return
        if not voices:
            raise BadRequest(f"{param}: this model's audio takes no voice; leave it out", param=param)
        if voice not in voices:
            raise BadRequest(
                f"{param}: voice '{voice}' is not one of this model's voices: {', '.join(sorted(voices))}",
                param=param,
            )

    def voices(self) -> frozenset[str] | None:
        """The voices this pipeline speaks in: those every stage on the audio route that takes
        a voice speaks in (none: it takes no voice); None while one has not declared its own."""
        spoken: frozenset[str] | None = None
        for stage in self.spec.needed_stages({OutputKind.AUDIO}):
            if (own := self.bus.table.declared(stage, "voices")) is None:
                return None
            if own:
                spoken = own if spoken is None else spoken & own
        return spoken or frozenset()

    def check_clip(
        self,
        width: int | None,
        height: int | None,
        seconds: float | None,
        fps: int | None,
        num_frames: int | None,
    ) -> None:
        """A 400 naming the field, for a video the stages that make it have said they cannot
        (omni_pipeline.clips); nothing while none has said (the stage refuses it then)."""
        for stage in self.spec.needed_stages({OutputKind.VIDEO}):
            if (limits := self.bus.table.clip_limits(stage)) is None:
                continue
            try:
                if width is not None or height is not None:
                    check_size(
                        width or limits.multiple, height or limits.multiple, limits.multiple, limits.max_size
                    )
                clip_frames(limits, seconds, fps, num_frames)
            except ClipError as exc:
                raise BadRequest(str(exc), param=exc.param) from None

    def _sources_declare(
        self, outputs: frozenset[OutputKind], what: Literal["accepts", "honours"]
    ) -> frozenset[str] | None:
        """What every source stage on these outputs' route declares it reads (`accepts`) or
        honours; None while one of them has not declared its own."""
        declared: frozenset[str] | None = None
        for stage in self.spec.needed_stages(set(outputs)):
            if stage not in self.attempts.sources:
                continue
            if what == "honours" and self.spec.stage(stage).skip_without_media:
                # Not its to decide: a request without media never reaches it (an encoder), and
                # the same field must not be honoured or refused by whether media came along.
                continue
            if (own := self.bus.table.declared(stage, what)) is None:
                return None
            declared = own if declared is None else declared & own
        return declared

    # --- tokens ------------------------------------------------------------------------------

    async def tokenize(self, msg: TokenizeMsg | DetokenizeMsg) -> TokenizeReply:
        """Ask the first source stage's replicas (one answers) to tokenize or detokenize, with
        the tokenizer and chat template its engine reads the client's prompt with."""
        stage = next(
            (
                s.name
                for s in self.spec.stages
                if s.name in self.attempts.sources and not s.skip_without_media
            ),
            None,
        )
        nc = self.bus.nc
        if stage is None or self.bus.table.tokenizes(stage) is False:
            raise NotServed(
                f"model '{self.spec.served_model_name}' has no tokenizer to count with "
                f"(no source stage's engine reads text)"
            )
        if nc is None:
            raise Unavailable("the gateway is not connected to NATS")
        try:
            reply = await nc.request(self.bus.subjects.tokenize(stage), pack(msg), timeout=TOKENIZE_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            raise Unavailable(
                f"stage '{stage}' has no replica that tokenizes (none live, or its engine reads no text)"
            ) from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise Unavailable(f"stage '{stage}' did not answer in {TOKENIZE_TIMEOUT_S:g}s") from None
        answer: TokenizeReply = unpack(reply.data, TokenizeReply)
        if not answer.ok:
            if answer.code == ErrorCode.INVALID_REQUEST:
                raise BadRequest(f"stage '{stage}': {answer.message}")
            raise StageFailed(f"stage '{stage}': {answer.message}")
        return answer

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
                async with contextlib.aclosing(self.attempts.run(arid, deadline, req)) as events:
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

    async def run_choices(
        self, rid: str, n: int, req: Prepared, *, whole: bool = False
    ) -> AsyncIterator[OfChoice]:
        """`n` replies to one request, as `n` requests side by side, their events interleaved as
        they come: vLLM's own parallel sampling is `n` child requests too, child `i` seeded
        with the request's seed plus `i` (unseeded children sample independently). Closing
        the iterator aborts them all; one failing fails the whole."""
        events: asyncio.Queue[tuple[int, Event | Exception | None]] = asyncio.Queue(EVENT_QUEUE)

        async def child(i: int) -> None:
            seed = req.sampling.seed
            seeded = msgspec.structs.replace(req.sampling, seed=seed + i) if seed is not None else None
            run = self.run(
                f"{rid}.{i}", req if seeded is None else replace(req, sampling=seeded), whole=whole
            )
            try:
                async for ev in run:
                    await events.put((i, ev))
                await events.put((i, None))
            except Exception as exc:
                await events.put((i, exc))
            finally:
                await run.aclose()  # aborts it, if it had not ended

        children = [
            asyncio.get_running_loop().create_task(child(i), name=f"choice-{rid}.{i}") for i in range(n)
        ]
        try:
            running = n
            while running:
                i, ev = await events.get()
                if ev is None:
                    running -= 1
                elif isinstance(ev, Exception):
                    raise ev
                else:
                    yield OfChoice(i, ev)
        finally:
            for task in children:
                task.cancel()
            await asyncio.gather(*children, return_exceptions=True)
