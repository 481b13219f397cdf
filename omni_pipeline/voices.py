"""Voices people upload (POST /v1/audio/voices): what a cloning stage takes from a clip, once, and
what is kept of it, so that no request computes it again.

The gateway asks a source stage that clones (its engine announces it reads `ref_audio`) by
request/reply on the stage's clone subject, the clip on the stage's request edge's connector as
a request's media go (never in the NATS message: a clip is larger than one carries); the reply
is a `VoicePrint`, which the gateway keeps in its voice store and sends with each request that
names the voice. The print's tensors travel as raw little-endian bytes: never pickled.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from omni_pipeline.connectors import ConnectorHandle


class CloneVoiceMsg(msgspec.Struct, tag="clone_voice", frozen=True, omit_defaults=True):
    """A clip to take a voice from: a RequestPayload on the stage's request edge (`payload`,
    under `request_id`: its `inputs.ref_audio` refers to the clip in its media, as a speech
    request's does), and the clip's transcript, for cloning in context (its codes taken too)."""

    request_id: str
    payload: ConnectorHandle
    ref_text: str | None = None


class VoicePrint(msgspec.Struct, frozen=True, omit_defaults=True):
    """The speaker's x-vector (float32 [dim]) and, for cloning in context, the clip's codes
    (int32 [frames, groups]) and its transcript."""

    x_vector: bytes
    codes: bytes = b""
    groups: int = 0
    ref_text: str | None = None

    @classmethod
    def of(cls, x_vector: torch.Tensor, codes: torch.Tensor | None, ref_text: str | None) -> VoicePrint:
        vector = x_vector.detach().float().cpu().numpy().astype("<f4").tobytes()
        if codes is None:
            return cls(vector)
        held = codes.detach().cpu().numpy().astype("<i4")
        return cls(vector, held.tobytes(), int(held.shape[1]), ref_text)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The x-vector [dim] and the codes [frames, groups] (None: the x-vector alone)."""
        x_vector = torch.from_numpy(np.frombuffer(self.x_vector, dtype="<f4").copy())
        if not self.codes:
            return x_vector, None
        codes = np.frombuffer(self.codes, dtype="<i4").reshape(-1, self.groups)
        return x_vector, torch.from_numpy(codes.astype(np.int64))


class CloneVoiceReply(msgspec.Struct, tag="cloned", frozen=True, omit_defaults=True):
    """The print, or why not (`code`: INVALID_REQUEST is the client's error)."""

    ok: bool
    voice: VoicePrint | None = None
    code: str = ""
    message: str = ""
