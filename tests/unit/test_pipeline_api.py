"""The gateway's pipeline API (what every front end calls), driven without NATS: every pre-flight
check once, in `prepare`, against the replica table as heartbeats fill it; and `run`'s bounded
wait for a replica when there is none to route to."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import AsyncIterator

import pytest
import soundfile
import torch

from omni_gateway.errors import BadRequest, ModelNotFound, Unavailable
from omni_gateway.pipeline import Pipeline
from omni_gateway.request import PipelineRequest
from omni_pipeline.control import Heartbeat, RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind, load_pipeline
from tests.helpers import ROOT

TEXT = frozenset({OutputKind.TEXT})
AUDIO = frozenset({OutputKind.TEXT, OutputKind.AUDIO})


@pytest.fixture
async def pipeline() -> AsyncIterator[Pipeline]:
    """tests/data/synthetic.yaml's gateway, never connected, waiting at most 0.2 s for a replica."""
    spec = load_pipeline(ROOT / "tests" / "data" / "synthetic.yaml")
    gateway = spec.spec.gateway.model_copy(update={"replica_wait_s": 0.2, "max_waiting_requests": 1})
    p = Pipeline(spec.model_copy(update={"spec": spec.spec.model_copy(update={"gateway": gateway})}), "")
    yield p
    p.payloads.close()


def announce(p: Pipeline, stage: str, **declared: list[str]) -> None:
    """A replica's heartbeat, as the bus would hand it to the table."""
    hb = Heartbeat(stage, "0", f"{stage}-i", 1, "host", 0, 0, 4, 4, False, 1.0, **declared)  # type: ignore[arg-type]
    p.announced.table.update(hb, time.monotonic())


def chat(text: str = "hi", **fields: object) -> PipelineRequest:
    messages = fields.pop("messages", [{"role": "user", "content": text}])
    return PipelineRequest(
        fields.pop("model", "synth"),  # type: ignore[arg-type]
        fields.pop("outputs", TEXT),  # type: ignore[arg-type]
        RequestInputs(["text"], messages=messages),  # type: ignore[arg-type]
        Sampling.of(fields.pop("sampling", {"max_tokens": 4})),  # type: ignore[arg-type]
        outputs_param="modalities",
        voice_param="audio.voice",
        declared=frozenset({"max_tokens", "voice"}),
    )


async def test_another_models_name_is_a_404_and_an_output_it_does_not_make_a_400(pipeline: Pipeline) -> None:
    with pytest.raises(ModelNotFound):
        await pipeline.prepare(chat(model="gpt-4o"))
    with pytest.raises(BadRequest) as exc:
        await pipeline.prepare(chat(outputs=frozenset({OutputKind.IMAGE})))
    assert exc.value.param == "modalities" and "cannot output image" in exc.value.message


async def test_max_tokens_over_the_limit_names_the_clients_field(pipeline: Pipeline) -> None:
    limit = pipeline.spec.gateway.max_tokens
    with pytest.raises(BadRequest) as exc:
        await pipeline.prepare(chat(sampling={"max_tokens": limit + 1}))
    assert exc.value.param == "max_tokens"


async def test_parameters_are_refused_only_once_the_source_stages_declared_theirs(pipeline: Pipeline) -> None:
    asked = chat(sampling={"max_tokens": 4, "temperature": 0.5})
    assert (await pipeline.prepare(asked)).sampling.temperature == 0.5  # nothing declared yet
    announce(pipeline, "thinker", honours=["seed"], accepts=["text"])
    with pytest.raises(BadRequest) as exc:
        await pipeline.prepare(asked)
    assert exc.value.param == "temperature"
    announce(pipeline, "thinker", honours=["seed", "temperature"], accepts=["text"])
    assert (await pipeline.prepare(asked)).sampling == Sampling(max_tokens=4, temperature=0.5)


async def test_an_unknown_voice_is_refused_listing_the_voices(pipeline: Pipeline) -> None:
    for stage in ("thinker", "talker"):
        announce(pipeline, stage, voices=[])
    announce(pipeline, "vocoder", voices=["alloy", "echo"])
    with pytest.raises(BadRequest) as exc:
        await pipeline.prepare(chat(outputs=AUDIO, sampling={"max_tokens": 4, "voice": "nova"}))
    assert exc.value.param == "audio.voice" and "alloy, echo" in exc.value.message
    await pipeline.prepare(chat(outputs=AUDIO, sampling={"max_tokens": 4, "voice": "echo"}))


async def test_media_are_decoded_once_and_refused_where_the_model_cannot_read_them(
    pipeline: Pipeline,
) -> None:
    buf = io.BytesIO()
    soundfile.write(buf, [0.0] * 1600, 16000, format="WAV")
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"},
    }
    messages = [{"role": "user", "content": [{"type": "text", "text": "hear"}, part]}]
    req = await pipeline.prepare(chat(messages=messages))
    (tensor,) = req.media.values()
    assert isinstance(tensor, torch.Tensor) and tensor.numel() > 0
    assert req.inputs.messages is not None and req.inputs.messages[0]["content"][1] != part  # a reference now
    announce(pipeline, "thinker", accepts=["text"])
    with pytest.raises(BadRequest) as exc:
        await pipeline.prepare(chat(messages=messages))
    assert exc.value.param == "messages[0].content[1]"


async def test_without_a_replica_to_route_to_a_request_waits_then_is_a_503(pipeline: Pipeline) -> None:
    req = await pipeline.prepare(chat())
    with pytest.raises(Unavailable) as exc:
        await anext(pipeline.run("r1", req))
    assert "not connected to NATS" in exc.value.message and exc.value.headers == {"Retry-After": "1"}
    assert pipeline.requests_in_flight() == 0  # nothing was tracked for it
