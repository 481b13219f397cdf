"""Taking a voice from a clip (POST /v1/audio/voices): asked of a source stage that clones (its
replicas announce they read `ref_audio`; one answers), the clip on the stage's request edge as
a speech request's clip goes, freed here whatever the answer."""

from __future__ import annotations

import secrets
from typing import Final

import nats.errors
import torch

from omni_gateway.bus import Bus
from omni_gateway.errors import BadRequest, StageFailed, Unavailable
from omni_gateway.preflight import Announced
from omni_pipeline.connectors import ConnectorError
from omni_pipeline.connectors.offload import OffLoop
from omni_pipeline.control import ErrorCode, RequestInputs, RequestPayload, pack, unpack
from omni_pipeline.spec import REQUEST_SOURCE, OutputKind
from omni_pipeline.voices import CloneVoiceMsg, CloneVoiceReply, VoicePrint

CLONE_TIMEOUT_S: Final = 60.0
"""How long an upload waits for a stage to take the voice (a long clip through two encoders)."""
CLIP: Final = "ref_audio"
"""The media key a voice's clip travels under (a speech request's `ref_audio`, an upload's)."""
X_VECTOR: Final = "voice_x_vector"
CODES: Final = "voice_codes"
"""The media keys an uploaded voice's print travels under."""


def cloning_stage(announced: Announced) -> str | None:
    """The source stage that clones, if one has said so (None: none does, or none has said)."""
    for stage in announced.sources(frozenset({OutputKind.AUDIO})):
        if "ref_audio" in (announced.table.declared(stage, "accepts") or ()):
            return stage
    return None


async def clone_voice(
    bus: Bus, payloads: OffLoop, announced: Announced, pcm: torch.Tensor, rate: int, ref_text: str | None
) -> VoicePrint:
    """The print of the clip's voice, as the cloning stage takes it."""
    stage = cloning_stage(announced)
    if stage is None:
        raise BadRequest(
            f"audio_sample: model '{announced.spec.served_model_name}' clones no voice (Base models do)",
            param="audio_sample",
        )
    if bus.nc is None:
        raise Unavailable("the gateway is not connected to NATS")
    rid = f"voice-{secrets.token_hex(8)}"
    edge = next(e for s, e in announced.spec.consumers(REQUEST_SOURCE) if s.name == stage)
    conn = payloads.connectors[edge.connector]
    payload = RequestPayload(RequestInputs(ref_audio={"media": CLIP, "sample_rate": rate}), {CLIP: pcm})
    try:
        try:
            _, _, handle = await payloads.put(conn, REQUEST_SOURCE, stage, rid, payload)
        except ConnectorError as exc:
            raise StageFailed(f"gateway -> stage '{stage}': {exc}", code=ErrorCode.CONNECTOR_ERROR) from None
        msg = bus.sized(pack(CloneVoiceMsg(rid, handle, ref_text)))
        try:
            reply = await bus.nc.request(bus.subjects.clone(stage), msg, timeout=CLONE_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            raise Unavailable(f"stage '{stage}' has no replica that clones (none live)") from None
        except (TimeoutError, nats.errors.TimeoutError):
            raise Unavailable(f"stage '{stage}' did not answer in {CLONE_TIMEOUT_S:g}s") from None
    finally:
        await payloads.call(conn.cleanup, rid)  # read or not, the clip goes
    answer = unpack(reply.data, CloneVoiceReply)
    if answer.ok and answer.voice is not None:
        return answer.voice
    if answer.code == ErrorCode.INVALID_REQUEST:
        raise BadRequest(f"audio_sample: {answer.message}", param="audio_sample")
    if answer.code == ErrorCode.SLEEPING:
        raise Unavailable(f"stage '{stage}' is asleep: wake it (POST /v1/omni/wakeup) to take voices")
    raise StageFailed(f"stage '{stage}': {answer.message}")
