"""Qwen2.5-Omni's thinker on vLLM's real CPU build (`engine: {kind: vllm, args: {part:
thinker}}`), feeding the transformers talker and code2wav as the pipeline does: text, codec
codes and waveform equal transformers' own `generate(..., return_audio=True)`, with audio and
an image in the message too. The hidden states the talker reads come from vLLM's workers
(omni_stage/engines/vllm/worker.py); nothing here stands in for vLLM."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import EngineSpec, load_pipeline
from omni_stage.engines.base import Engine, EngineCall, EngineError
from omni_stage.engines.registry import build_engine
from omni_stage.models.qwen2_5_omni.vllm_thinker import VllmThinker
from tests.helpers import VLLM_TIMEOUT_S, wait_for
from tests.integration.test_vllm import LoopThread
from tests.qwen_reference import (
    media_clips,
    media_message,
    reference_generate,
    reference_with_media,
    reference_with_video,
    video_clip,
    video_message,
)
from tests.unit.test_qwen_omni import (
    EXAMPLE,
    MESSAGES,
    SEED,
    TALKER_CODES,
    THINKER_TOKENS,
    engine,
    run_pipeline,
)

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT_S)


def vllm_thinker(model: Path, **args: Any) -> VllmThinker:
    spec = load_pipeline(EXAMPLE).spec.stage("thinker")
    engine = EngineSpec(kind="vllm", model=str(model), args={"part": "thinker", **args})
    built = build_engine(spec.model_copy(update={"engine": engine}))
    assert isinstance(built, VllmThinker)
    return built


@pytest.fixture(scope="module")
def model(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-qwen2.5-omni"


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def thinker(model: Path, loop: LoopThread) -> Iterator[VllmThinker]:
    """Prefill in chunks of 128 tokens: every prompt here (245 tokens and more) takes two or
    more steps, whose rows must land at their positions."""
    engine = vllm_thinker(model, max_model_len=2048, dtype="float32", max_num_batched_tokens=128)
    loop.run(engine.start(), timeout=300)
    yield engine
    loop.run(engine.close())


def assert_equal(ours: dict[str, Any], ref: dict[str, Any]) -> None:
    assert ours["tokens"].tolist() == ref["tokens"].tolist()
    assert ours["text"] == ref["text"]
    assert ours["codes"].tolist() == ref["codes"].tolist()
    assert ours["audio"].shape == ref["audio"].shape
    torch.testing.assert_close(ours["audio"], ref["audio"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("thinker_window", [1, 1000])
def test_text_codes_and_audio_equal_the_reference(
    model: Path, thinker: VllmThinker, loop: LoopThread, thinker_window: int
) -> None:
    """vLLM's greedy tokens are the reference's, and its hidden states within 1e-6 of it, so
    the talker's codes are the same and the waveform within 1e-5, as with the transformers
    thinker (tests/unit/test_qwen_omni.py)."""
    ref = reference_generate(model, MESSAGES, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    ours = loop.run(run_pipeline(model, "Ethan", thinker_window, thinker=thinker), timeout=300)
    assert_equal(ours, ref)
    assert len(ours["codes"]) > 8


def test_with_audio_and_an_image_as_well(model: Path, thinker: VllmThinker, loop: LoopThread) -> None:
    """vLLM runs the model's processor on the clip and image the gateway's code decoded; the
    talker gets zeros where their features sit."""
    ref = reference_with_media(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    message = media_message(*media_clips())
    ours = loop.run(run_pipeline(model, "Ethan", 4, [message], thinker=thinker), timeout=300)
    assert_equal(ours, ref)


def test_mm_processor_kwargs_as_the_reference_takes_them(
    model: Path, thinker: VllmThinker, loop: LoopThread
) -> None:
    """vLLM's `mm_processor_kwargs` (a minimum pixel count that scales the image up), handed
    to vLLM's processor as vLLM's server hands them: the reference's answer with them."""
    bigger = {"min_pixels": 20000}
    ref = reference_with_media(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan", bigger)
    message = media_message(*media_clips())
    extra = {"mm_processor_kwargs": bigger}
    ours = loop.run(run_pipeline(model, "Ethan", 1000, [message], thinker=thinker, extra=extra), timeout=300)
    assert_equal(ours, ref)


def test_concurrent_requests_get_their_own_hidden_states(
    model: Path, thinker: VllmThinker, loop: LoopThread
) -> None:
    """Two requests in vLLM's batch at once: each talker gets its own request's rows."""
    ref_text = reference_generate(model, MESSAGES, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    ref_media = reference_with_media(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")

    async def both() -> list[dict[str, Any]]:
        message = media_message(*media_clips())
        return list(
            await asyncio.gather(
                run_pipeline(model, "Ethan", 1, thinker=thinker),
                run_pipeline(model, "Ethan", 1, [message], thinker=thinker),
            )
        )

    text, media = loop.run(both(), timeout=300)
    assert_equal(text, ref_text)
    assert_equal(media, ref_media)


def test_what_would_send_the_talker_wrong_states_is_refused(model: Path) -> None:
    with pytest.raises(EngineError, match="enable_prefix_caching"):
        vllm_thinker(model, enable_prefix_caching=True)
    with pytest.raises(EngineError, match="speculative_config"):
        vllm_thinker(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_an_encoder_stage_in_front_of_it_is_refused(model: Path) -> None:
    """It runs its own encoders, so an encoder stage's work would be thrown away: the stage
    says so when it is built, not by encoding every medium twice."""
    spec = load_pipeline(EXAMPLE).spec.stage("thinker")
    engine = EngineSpec(kind="vllm", model=str(model), args={"part": "thinker"})
    inputs = [*spec.inputs, spec.inputs[0].model_copy(update={"from_": "encoder"})]
    with pytest.raises(EngineError, match="inputs: the thinker on vLLM reads only `request`, not 'encoder'"):
        build_engine(spec.model_copy(update={"engine": engine, "inputs": inputs}))


def test_with_a_video(model: Path, thinker: VllmThinker, loop: LoopThread) -> None:
    """The gateway's code takes 2 frames a second; vLLM runs the model's processor on them at
    that rate; the reference gets the same frames through the model's processor."""
    ref = reference_with_video(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    message = video_message(video_clip()[0])
    ours = loop.run(run_pipeline(model, "Ethan", 4, [message], thinker=thinker), timeout=300)
    assert_equal(ours, ref)


def test_an_answer_ending_at_eos_is_the_same_units_as_the_transformers_thinkers(
    model: Path, thinker: VllmThinker, loop: LoopThread
) -> None:
    """The eos token is a unit of its own (the talker reads its reply state) on both thinkers:
    forced here with a logit bias, as the first token."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    sampling = {"max_tokens": 8, "logit_bias": {str(eos): 100.0}}

    async def answer(one: Engine) -> list[tuple[int, list[int], list[str], str | None]]:
        call = EngineCall("e", {"request": {"messages": MESSAGES}}, True, Sampling.of(dict(sampling)))
        outs = [o async for o in one.generate(call)]
        return [(o.units, o.data["token_ids"].tolist(), sorted(o.data), o.finish_reason) for o in outs]

    async def reference() -> list[tuple[int, list[int], list[str], str | None]]:
        hf = engine("thinker", model)
        await hf.start()
        return await answer(hf)

    ours = loop.run(answer(thinker))
    first = ["prompt_embeds", "prompt_hidden", "token_ids"]
    assert ours == asyncio.run(reference()) == [(1, [eos], first, "stop")]


def test_an_aborted_request_leaves_nothing_in_vllm_or_the_hidden_state_store(
    thinker: VllmThinker, loop: LoopThread
) -> None:
    first = threading.Event()

    async def long_request() -> None:
        call = EngineCall("long", {"request": {"messages": MESSAGES}}, True, Sampling(max_tokens=1000))
        async for _ in thinker.generate(call):
            first.set()

    fut = asyncio.run_coroutine_threadsafe(long_request(), loop.loop)
    assert first.wait(60)
    assert thinker.active_requests() == 1 and thinker.hidden is not None and thinker.hidden.held() == 1
    fut.cancel()  # what a stage does when the request is aborted
    wait_for(lambda: thinker.active_requests() == 0, 30, "vLLM to drop the aborted request")
    wait_for(lambda: thinker.hidden is not None and thinker.hidden.held() == 0, 30, "the rows to be freed")
