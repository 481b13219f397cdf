"""Qwen3-Omni's three stages, driven directly (no processes) and fed window by window as the
pipeline feeds them, against the reference: transformers' own
`Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`, greedy, on the same
tiny checkpoint and inputs (tests/qwen_reference.py says how it is called)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from torch._dynamo.utils import counters

from omni_gateway.media import decode_media
from omni_pipeline.sampling import Sampling
from omni_pipeline.settings import MediaSpec
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall, EngineError, InvalidRequest
from omni_stage.engines.registry import build_engine
from omni_stage.payload import concat
from tests.helpers import COMPILE_TIMEOUT_S, ROOT, asked_while_held, example_stage
from tests.qwen_reference import (
    MEDIA_QUESTION,
    PREFILL_QUESTIONS,
    VIDEO_QUESTION,
    check_a_bounded_talker,
    check_first_audio_under_load,
    check_prompts_prefilled_together,
    check_talker_prompts_prefilled_together,
    counts_uncompiled,
    media_clips,
    media_message,
    reference_qwen3,
    slot_table,
    video_clip,
    video_message,
    windows,
)

EXAMPLE = ROOT / "examples" / "qwen3-omni.yaml"
QUESTION = "Tell me about the sea."
THINKER_TOKENS, TALKER_CODES = 12, 30
WHOLE = {"chunkCodes": 300}  # after the first code, the rest in one piece: the reference's chunk


def engine(stage: str, model: Path, **args: Any) -> Engine:
    if stage == "encoder":  # the thinker's stage spec, as an encoder: what the part builds on
        spec = load_pipeline(EXAMPLE).spec.stage("thinker")
        eng = spec.engine.model_copy(update={"model": str(model), "args": {"part": "encoder", "threads": 1}})
        return build_engine(spec.model_copy(update={"engine": eng, "name": "encoder"}))
    return example_stage(EXAMPLE, stage, model, **args)


async def run_pipeline(
    model: Path,
    message: dict[str, Any],
    thinker_window: int,
    voice: str = "Ethan",
    split: bool = False,
    fixed: bool = False,
    talker_args: dict[str, Any] | None = None,
    **code2wav: int,
) -> dict[str, Any]:
    """The three stages; `message` as a client sends it (media decoded by the gateway's code).
    `split`: an encoder stage reads the media and the thinker its outputs, not the media.
    `fixed`: the thinker and the talker step at fixed shapes on their slot tables.
    `talker_args` over the talker's engine arguments."""
    steps = {"fixedSteps": True} if fixed else {}
    thinker, talker, decoder = (
        engine("thinker", model, **steps),
        engine("talker", model, **steps, **(talker_args or {})),
        engine("code2wav", model, **code2wav),
    )
    for e in (thinker, talker, decoder):
        await e.start()
    messages, media = await decode_media([message], MediaSpec())
    request = {"messages": messages, "media": media.tensors}
    sampling = {"max_tokens": THINKER_TOKENS}
    inputs: dict[str, Any] = {"request": request}
    if split:
        encoder = engine("encoder", model)
        await encoder.start()
        encoded = [
            o
            async for o in encoder.generate(
                EngineCall("r", {"request": request}, True, Sampling.of(sampling))
            )
        ]
        inputs = {"request": request | {"media": {}}, "encoder": concat([o.data for o in encoded])}
    thought = [o async for o in thinker.generate(EngineCall("r", inputs, True, Sampling.of(sampling)))]
    state = CallState()
    codes = []
    for payload, last in windows(thought, thinker_window):
        call = EngineCall(
            "r", {"thinker": payload}, last, Sampling(max_tokens=TALKER_CODES, voice=voice), state
        )
        codes += [o async for o in talker.generate(call)]
    code_data = concat([o.data for o in codes])
    audio_state = CallState()
    audio = []
    edge = load_pipeline(EXAMPLE).spec.stage("code2wav").inputs[0]
    for payload, last in windows(codes, edge.window, edge.first_window):  # as the example's edge feeds it
        audio += [
            o
            async for o in decoder.generate(
                EngineCall("r", {"talker": payload}, last, Sampling(), audio_state)
            )
        ]
    return {
        "tokens": torch.cat([o.data["token_ids"] for o in thought]),
        "text": "".join(o.text for o in thought),
        "codes": code_data["codes"],
        "audio": torch.cat([o.data["audio"] for o in audio]),
    }


@pytest.fixture(scope="module")
def model(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-qwen3-omni"


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, Any]:
    parts = [{"type": "text", "text": QUESTION}]
    return reference_qwen3(model, parts, THINKER_TOKENS, TALKER_CODES, "Ethan")


def assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Text token for token, every codebook of every code, and the waveform within 1e-6 (the
    same operations on the same numbers: 0 measured)."""
    assert ours["tokens"].tolist() == theirs["tokens"].tolist()
    assert ours["text"] == theirs["text"]
    assert ours["codes"].tolist() == theirs["codes"].tolist()
    assert ours["codes"].shape[0] > 8 and ours["codes"].shape[1] == 4
    assert ours["audio"].shape == theirs["audio"].shape
    assert float(theirs["audio"].std()) > 0.01  # a real waveform, not a silent one
    torch.testing.assert_close(ours["audio"], theirs["audio"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("thinker_window", "fixed"), [(1, False), (4, False), (1000, False), (4, True)], ids=str
)
def test_the_stages_compute_what_the_reference_computes(
    model: Path, reference: dict[str, Any], thinker_window: int, fixed: bool
) -> None:
    """So with the thinker and the talker each stepping on its slot table at fixed shapes
    (`fixedSteps`: what `cudaGraphs` replays on CUDA)."""
    message = {"role": "user", "content": QUESTION}
    assert_same(asyncio.run(run_pipeline(model, message, thinker_window, fixed=fixed, **WHOLE)), reference)


def test_a_talker_bounded_by_max_model_len_speaks_the_references_first_codes(
    model: Path, reference: dict[str, Any]
) -> None:
    """The talker at fixed shapes with `maxModelLen`: a prompt past it refused, a bound past
    the prompt the reference's first codes (check_a_bounded_talker)."""
    message = {"role": "user", "content": QUESTION}

    def bounded(bound: int) -> dict[str, Any]:
        talker = {"maxModelLen": bound}
        return asyncio.run(run_pipeline(model, message, 4, fixed=True, talker_args=talker, **WHOLE))

    check_a_bounded_talker(bounded, reference)


@pytest.mark.parametrize("fixed", [False, True], ids=["own caches", "slot table"])
def test_prompts_of_text_queued_together_are_prefilled_together_as_each_alone(
    model: Path, fixed: bool
) -> None:
    """As Qwen2.5-Omni's thinker (check_prompts_prefilled_together): one forward of its MoE
    layers for the prompts queued behind a prefill, each request thinking what it thinks alone."""
    args = {"prefillBatchTokens": 2048} | ({"fixedSteps": True, "maxModelLen": 256} if fixed else {})
    check_prompts_prefilled_together(engine("thinker", model, **args), PREFILL_QUESTIONS, THINKER_TOKENS)


@pytest.mark.parametrize("args", [{}, {"fixedSteps": True}], ids=["own shapes", "fixed shapes"])
def test_talker_prompts_queued_together_are_prefilled_together_as_each_alone(
    model: Path, args: dict[str, Any]
) -> None:
    """As Qwen2.5-Omni's talker (check_talker_prompts_prefilled_together): one forward of the
    talker's MoE layers for the prompts queued behind a prefill, each request speaking the
    codes, every codebook, it speaks alone."""
    check_talker_prompts_prefilled_together(
        engine("thinker", model),
        engine("talker", model, prefillBatchTokens=2048, **args),
        PREFILL_QUESTIONS,
        TALKER_CODES,
        "Ethan",
    )


def test_with_audio_and_an_image(model: Path, reference: dict[str, Any]) -> None:
    """An audio clip and an image in the message: the thinker builds the prompt as the model's
    processor does, the talker places the media's states by their layout; the reference gets
    them through the model's processor. Not the text-only answer."""
    wav, png = media_clips()
    clip, _ = soundfile.read(io.BytesIO(wav), dtype="float32")
    parts = [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": MEDIA_QUESTION}]
    theirs = reference_qwen3(
        model,
        parts,
        THINKER_TOKENS,
        TALKER_CODES,
        "Ethan",
        audio=[clip],
        images=[Image.open(io.BytesIO(png))],
    )
    ours = asyncio.run(run_pipeline(model, media_message(wav, png), 4, **WHOLE))
    assert_same(ours, theirs)
    assert ours["tokens"].tolist() != reference["tokens"].tolist()


def test_with_a_video(model: Path) -> None:
    """A video: the gateway takes 2 frames a second of the 4 fps clip; the reference gets the
    same frames at that rate through the model's processor."""
    mkv, frames = video_clip()
    parts = [{"type": "video"}, {"type": "text", "text": VIDEO_QUESTION}]
    theirs = reference_qwen3(
        model, parts, THINKER_TOKENS, TALKER_CODES, "Ethan", videos=[frames[::2]], fps=2.0
    )
    assert_same(asyncio.run(run_pipeline(model, video_message(mkv), 4, **WHOLE)), theirs)


def test_the_voice_picks_the_speaker(model: Path, reference: dict[str, Any]) -> None:
    """Chelsie's speech is the reference's for Chelsie, and not Ethan's."""
    message = {"role": "user", "content": QUESTION}
    parts = [{"type": "text", "text": QUESTION}]
    theirs = reference_qwen3(model, parts, THINKER_TOKENS, TALKER_CODES, "Chelsie")
    ours = asyncio.run(run_pipeline(model, message, 4, voice="Chelsie", **WHOLE))
    assert_same(ours, theirs)
    assert ours["codes"].tolist() != reference["codes"].tolist()


def test_audio_streamed_in_chunks_is_the_whole(model: Path, reference: dict[str, Any]) -> None:
    """The example's code2wav streams: its first code, then pieces of 12 codes, each
    decoded once from what the codes before it left, the 555 samples a piece leaves to the
    next code coming with the next piece: every sample of the reference's one decode there,
    within float rounding (the attention's 72 codes back and the convolutions' reach carried,
    not cut at a context)."""
    message = {"role": "user", "content": QUESTION}
    ours = asyncio.run(run_pipeline(model, message, 4))
    assert ours["codes"].tolist() == reference["codes"].tolist()
    assert ours["audio"].shape == reference["audio"].shape
    torch.testing.assert_close(ours["audio"], reference["audio"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["leftContextCodes", "rightContextCodes"])
def test_a_streamed_decoder_takes_no_context(model: Path, name: str) -> None:
    with pytest.raises(EngineError, match=f"{name}: Qwen3-Omni's decoder streams"):
        engine("code2wav", model, **{name: 1})


def test_first_audio_after_one_code_alone_and_under_load_is_the_whole_decode(model: Path) -> None:
    """The first audio after one code (`firstChunkCodes`, the decoder's fewest: it is causal): its
    1365 final samples (1920 less the 555 its transposed convolutions leave to the next code);
    then pieces of 12 codes, streamed.
    Four requests at once: each one's first piece sized by the replica's load when its codes
    came (one code idle, more as the compute fills, up to `busyFirstChunkCodes`), pieces of a
    size batched; every request's audio the whole sequence's decode within 1e-5 (float
    rounding), whatever its first piece: the load changes when audio comes, not what."""
    edge = load_pipeline(EXAMPLE).spec.stage("code2wav").inputs[0]
    check_first_audio_under_load(engine("code2wav", model, maxBatch=4), (29, 30, 33, 36), edge, 555)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"firstChunkCodes": 0}, r"need 1 <= firstChunkCodes \(0\)"),
        ({"firstChunkCodes": 4, "busyFirstChunkCodes": 2}, r"<= busyFirstChunkCodes \(2\)"),
        ({"busyFirstChunkCodes": 13}, r"busyFirstChunkCodes \(13\) <= chunkCodes \(12\)"),
    ],
)
def test_a_first_chunk_out_of_its_bounds_is_refused(model: Path, args: dict[str, int], says: str) -> None:
    with pytest.raises(EngineError, match=says):
        engine("code2wav", model, **args)


def test_the_checkpoint_is_a_genuine_qwen3_omni(model: Path) -> None:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model)
    assert sorted(full.config.talker_config.speaker_id) == ["aiden", "chelsie", "ethan"]
    assert full.config.thinker_config.text_config.num_experts == 4
    proc = Qwen3OmniMoeProcessor.from_pretrained(model)
    assert proc.tokenizer.audio_token == "<|audio_pad|>"
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[1] == full.config.assistant_token_id and len(ids) == 3
    assert np.isfinite(full.thinker.lm_head.weight.detach().numpy()).all()


@pytest.mark.parametrize("form", ["own caches", "fixed"])
def test_concurrent_requests_think_in_batched_steps_with_the_same_tokens(model: Path, form: str) -> None:
    """Three requests of different prompt lengths (one with audio and an image) on one thinker
    replica at once (asked while its compute thread is held, so that each has its prompt built
    and its first step queued before any runs: the media prompt's build takes longer, and on a
    loaded machine the first request once ended its 8 tokens before the third's first step):
    their decode steps run as batches (each request's KV cache stacked,
    left-padded, masked) and each gets exactly the tokens it gets alone. With `fixedSteps:
    true` (what `cudaGraphs` captures on CUDA) the steps run on a slot table allocated once at
    `maxModelLen` positions a slot, at a bucket's fixed shapes: a request's cache is copied
    once, into its slot at its prefill, never at a step, no slot is held after, and the tokens
    are those of the thinker on its own caches; a prompt and reply past `maxModelLen` are
    refused, and it is the context the replica reports."""
    fixed = {"fixedSteps": True, "maxModelLen": 128} if form == "fixed" else {}
    requests = [
        {"role": "user", "content": QUESTION},
        media_message(*media_clips()),
        {"role": "user", "content": "A much longer question, to make the prompts differ in length: why?"},
    ]

    async def go() -> tuple[list[list[int]], list[list[int]], list[list[int]], Any]:
        thinker = engine("thinker", model, **fixed)
        await thinker.start()

        # Decoded first, so that the three reach the thinker in order, with nothing between.
        decoded = [await decode_media([m], MediaSpec()) for m in requests]

        async def think(messages: list[dict[str, Any]], media: Any, on: Engine = thinker) -> list[int]:
            request = {"messages": messages, "media": media.tensors}
            outs = [
                o
                async for o in on.generate(
                    EngineCall("r", {"request": request}, True, Sampling(max_tokens=8))
                )
            ]
            return [t for o in outs for t in o.data["token_ids"].tolist()]

        if fixed:
            copies, _, keys = slot_table(thinker)
        together = await asked_while_held(thinker, thinker.batcher, [think(*d) for d in decoded])  # type: ignore[attr-defined]
        sizes = thinker.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await think(*d) for d in decoded]
        own = alone
        if fixed:
            assert slot_table(thinker) == (copies + 2 * len(requests), 0, keys)
            assert thinker.prompt_tokenizer()[1] == 128  # (what /tokenize says of the context)
            with pytest.raises(InvalidRequest, match="context is 128 tokens"):
                long = EngineCall(
                    "r", {"request": {"messages": decoded[2][0]}}, True, Sampling(max_tokens=100)
                )
                [o async for o in thinker.generate(long)]
            others = engine("thinker", model)
            await others.start()
            own = [await think(*d, others) for d in decoded]
        return list(together), alone, own, sizes

    together, alone, own, sizes = asyncio.run(go())
    assert max(sizes) == 3, sizes
    assert together == alone == own


@pytest.mark.usefixtures("one_compile_at_a_time")
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
@pytest.mark.parametrize("form", ["eager", "compiled", "fixed"])
def test_concurrent_requests_talk_in_batched_steps_with_the_same_codes(model: Path, form: str) -> None:
    """Three requests of different prompt lengths (one with audio and an image) on one talker
    replica at once (asked while its compute thread is held, as the thinker's above: each
    prefilled, on the compute thread here, and its first step queued before any runs): their
    talker steps run as batches (caches stacked, left-padded, masked,
    each at its own M-RoPE position), so do the code predictor's residuals of their codes, and
    each request gets exactly the codes, every codebook, it gets alone. The steps write into
    the talker's slot table in place: a request's cache is copied once, into its slot at its
    prefill, never at a step, and its slot is given back at its end. `compile: true`
    (torch.compile of the talker's and the code predictor's decoder layers, here inductor on
    this CPU) speaks the same codes, together and alone, as the talker not compiled; so does
    `fixedSteps: true` (every step at a bucket's fixed shapes, over the table's whole length:
    what `cudaGraphs` captures on CUDA)."""
    compiled = form == "compiled"
    args = {"compiled": {"compile": True}, "fixed": {"fixedSteps": True}}.get(form, {})
    requests = [
        {"role": "user", "content": QUESTION},
        media_message(*media_clips()),
        {"role": "user", "content": "A much longer question, to make the prompts differ in length: why?"},
    ]

    async def go() -> tuple[list[list[list[int]]], list[list[list[int]]], Any, list[list[list[int]]]]:
        thinker, talker, eager = engine("thinker", model), engine("talker", model, **args), None
        await thinker.start()
        before = counters["stats"]["unique_graphs"]
        await talker.start()
        graphs = counters["stats"]["unique_graphs"]  # what torch.compile has compiled so far
        assert (graphs > before) == compiled  # the talker's forms compiled at its start
        if args:
            eager = engine("talker", model)
            await eager.start()
        thoughts = []
        for m in requests:
            messages, media = await decode_media([m], MediaSpec())
            call = EngineCall(
                "r", {"request": {"messages": messages, "media": media.tensors}}, True, Sampling(max_tokens=8)
            )
            thoughts.append(concat([o.data async for o in thinker.generate(call)]))

        async def talk(thought: dict[str, Any], on: Engine = talker) -> list[list[int]]:
            call = EngineCall(
                "r", {"thinker": thought}, True, Sampling(max_tokens=TALKER_CODES, voice="Ethan")
            )
            return concat([o.data async for o in on.generate(call)])["codes"].tolist()

        copies, _, keys = slot_table(talker)
        m = talker.model  # type: ignore[attr-defined]
        uncompiled: list[tuple[int, ...]] = []
        counting = [counts_uncompiled(d, uncompiled) for d in (m.model, m.code_predictor.model)]
        asks = [talk(t) for t in thoughts]
        together = await asked_while_held(talker, talker.batcher, asks, built_on_compute=True)  # type: ignore[attr-defined]
        sizes = talker.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [await talk(t) for t in thoughts]
        assert slot_table(talker) == (copies + 2 * len(thoughts), 0, keys)
        not_compiled = alone if eager is None else [await talk(t, eager) for t in thoughts]
        for handle in counting:
            handle.remove()
        for decoder in (m.model, m.code_predictor.model):
            assert hasattr(decoder, "_orig_mod") == compiled  # the decoder layers compiled, or not
        # Compiled at start: none since, and every forward of the requests ran what was compiled
        # (none past Dynamo's recompile limit, which runs a form it has no graph for uncompiled).
        assert counters["stats"]["unique_graphs"] == graphs
        if compiled:
            assert uncompiled == [], uncompiled
        return list(together), alone, sizes, not_compiled

    together, alone, sizes, not_compiled = asyncio.run(go())
    assert max(sizes) == 3, sizes
    assert all(len(codes) > 4 for codes in alone)
    assert together == alone == not_compiled


def test_static_frames_draw_what_generate_draws(model: Path) -> None:
    """The code predictor's graph-shaped frame (StaticFrames: a batch padded up to its bucket, a
    cache allocated once, a fixed loop of sub-steps; what the talker draws its frames with, and
    what CUDA replays as a graph) draws the codes transformers' `generate` draws for each frame,
    as the reference's talker calls it, alone and in batches (3 rows padded to 4, 4 rows
    exactly), on random inputs of the talker's width. The graphs themselves need CUDA:
    scripts/gpu_graphs.py holds them to the same codes where a GPU is lent."""
    from omni_stage.models.qwen3_omni.code_predictor import StaticFrames

    talker = engine("talker", model)
    asyncio.run(talker.start())
    m, groups = talker.model, talker.groups  # type: ignore[attr-defined]
    width = m.code_predictor.config.hidden_size
    gen = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        frames = StaticFrames(m, groups, max_batch=4, capture=False)
        assert frames.buckets == (1, 2, 4) and not frames.captured
        for n in (1, 3, 4, 1, 2):
            hidden = torch.randn(n, 1, width, generator=gen)
            code0 = torch.randint(0, 2048, (n,), generator=gen).tolist()
            drawn = frames.residuals(hidden, code0)
            first = m.get_input_embeddings()(torch.tensor([[c] for c in code0]))
            inputs = torch.cat([hidden, first], dim=1)  # as the reference's talker feeds it
            codes = m.code_predictor.generate(
                inputs_embeds=inputs, max_new_tokens=groups - 1, do_sample=False
            )
            assert drawn == codes[:, -(groups - 1) :].tolist()
            assert all(len(row) == groups - 1 for row in drawn)
    with pytest.raises(EngineError, match="cudaGraphs needs device: cuda"):
        engine("talker", model, cudaGraphs=True)


@pytest.mark.parametrize("media", ["audio and image", "video"])
def test_with_an_encoder_stage_the_pipeline_computes_the_same(model: Path, media: str) -> None:
    """The encoder stage (Qwen3-Omni's audio and vision encoders alone, its vision encoder's
    deepstack features sent with the rows) and the thinker reading its outputs instead of the
    media: the same text, codes and waveform as the thinker encoding itself."""
    message = media_message(*media_clips()) if media != "video" else video_message(video_clip()[0])
    whole = asyncio.run(run_pipeline(model, message, 4, **WHOLE))
    split = asyncio.run(run_pipeline(model, message, 4, split=True, **WHOLE))
    assert split["tokens"].tolist() == whole["tokens"].tolist()
    assert split["codes"].tolist() == whole["codes"].tolist()
    torch.testing.assert_close(split["audio"], whole["audio"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("split", [False, True], ids=["own encoders", "encoder stage"])
def test_a_conversation_kept_by_its_prompt_cache_key_thinks_as_a_whole_prefill(
    model: Path, split: bool
) -> None:
    """Qwen3-Omni's thinker on turn 2 of a conversation whose turns both have audio and an
    image (the vision encoder's deepstack features go to the first layers at the image's
    positions): with turn 1's `prompt_cache_key` it computes only what turn 2 adds, and sends
    the talker what the whole prefill sends (every position's embedding and state, the
    prompt's ids and layout) and the same reply."""
    wav, png = media_clips()
    image = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(image, "PNG")

    async def go() -> tuple[list[Any], list[Any], int]:
        thinker = engine("thinker", model)
        encoder = engine("encoder", model) if split else None
        for e in (thinker, encoder):
            if e is not None:
                await e.start()

        async def think(messages: list[dict[str, Any]], key: str | None) -> tuple[list[Any], int]:
            messages, media = await decode_media(messages, MediaSpec())
            request = {"messages": messages, "media": media.tensors}
            sampling = {"max_tokens": THINKER_TOKENS} | ({"prompt_cache_key": key} if key else {})
            inputs: dict[str, Any] = {"request": request}
            if encoder is not None:
                encoded = [
                    o
                    async for o in encoder.generate(
                        EngineCall("e", {"request": request}, True, Sampling.of(sampling))
                    )
                ]
                inputs = {"request": request | {"media": {}}, "encoder": concat([o.data for o in encoded])}
            call = EngineCall("r", inputs, True, Sampling.of(sampling))
            return [o async for o in thinker.generate(call)], call.state.cached_tokens

        first = media_message(wav, png)
        turn1, _ = await think([first], "c")
        second = [first, {"role": "assistant", "content": "".join(o.text for o in turn1)}]
        second.append(media_message(wav, image.getvalue()))
        kept, cached = await think(second, "c")
        whole, _ = await think(second, None)
        return kept, whole, cached

    kept, whole, cached = asyncio.run(go())
    assert cached > 0
    assert [o.data["token_ids"].tolist() for o in kept] == [o.data["token_ids"].tolist() for o in whole]
    assert kept[0].data.keys() == whole[0].data.keys()
    for name, value in whole[0].data.items():
        torch.testing.assert_close(kept[0].data[name], value, rtol=0, atol=1e-4, msg=name)


def test_the_talker_keeps_a_conversations_user_turns_and_speaks_as_a_whole_prefill(model: Path) -> None:
    """Qwen3-Omni's talker reads the prompt's user turns: with the conversation's
    `prompt_cache_key` turn 2's talker reuses turn 1's (fed the same rows, the thinker's kept
    ones) and draws the codes it draws prefilling them all."""
    wav, png = media_clips()

    async def go() -> tuple[list[list[int]], list[list[int]], int, int]:
        thinker, talker = engine("thinker", model), engine("talker", model)
        for e in (thinker, talker):
            await e.start()
        assert talker.prompt_caches is not None

        async def turn(messages: list[dict[str, Any]], key: str | None) -> tuple[str, list[list[int]]]:
            messages, media = await decode_media(messages, MediaSpec())
            keyed = {"prompt_cache_key": key} if key else {}
            request = {"request": {"messages": messages, "media": media.tensors}}
            thought = [
                o
                async for o in thinker.generate(
                    EngineCall("r", request, True, Sampling.of({"max_tokens": THINKER_TOKENS} | keyed))
                )
            ]
            state, codes = CallState(), []
            for payload, last in windows(thought, 4):
                call = EngineCall(
                    "r", {"thinker": payload}, last, Sampling.of({"max_tokens": TALKER_CODES} | keyed), state
                )
                codes += [o.data["codes"][0].tolist() async for o in talker.generate(call)]
            return "".join(o.text for o in thought), codes

        first = media_message(wav, png)
        said, _ = await turn([first], "c")
        second = [first, {"role": "assistant", "content": said}, {"role": "user", "content": QUESTION}]
        before = talker.prompt_caches.reused_tokens
        _, kept = await turn(second, "c")
        reused = talker.prompt_caches.reused_tokens - before
        _, whole = await turn(second, None)
        return kept, whole, reused, len(talker.prompt_caches)

    kept, whole, reused, held = asyncio.run(go())
    assert reused > 0 and held == 1
    assert len(kept) > 4 and kept == whole


def test_a_sessions_audio_encoded_as_it_arrives_in_8_s_windows_thinks_as_the_whole_prefill(
    model: Path,
) -> None:
    """Qwen3-Omni's audio tower convolves within 100 frames and attends within
    `n_window_infer` frames (800: 8 s), so its windows are 8 s. Two clips (17.3 s and 3.01 s)
    encoded window by window give the rows `get_audio_features` gives them whole, within
    float32 rounding; and a 17.3 s turn sent ahead in 100 ms pieces of 24 kHz PCM16 (two whole
    windows, encoded as they arrived, and a partial one at the request), asked with the
    session's key, thinks and sends the talker what the same request with no key does."""
    from tests.unit.test_qwen_omni import _pcm16, _speak_ahead, _spoken, windowed_and_whole

    pcm = _pcm16(17.3, lambda t: 0.3 + 0 * t)

    async def go() -> tuple[Any, ...]:
        thinker = engine("thinker", model)
        await thinker.start()
        whole_rows, windowed_rows, sizes = windowed_and_whole(thinker, (17.3, 3.01))

        async def think(key: str | None) -> list[Any]:
            messages, media = await decode_media([_spoken(pcm)], MediaSpec())
            sampling = {"max_tokens": THINKER_TOKENS} | ({"prompt_cache_key": key} if key else {})
            call = EngineCall(
                "r", {"request": {"messages": messages, "media": media.tensors}}, True, Sampling.of(sampling)
            )
            return [o async for o in thinker.generate(call)]

        await _speak_ahead(thinker, "s", pcm)
        asked, whole = await think("s"), await think(None)
        a = thinker.audio_ahead
        assert a is not None
        counts = (a.windows_ahead, a.windows_late)
        return whole_rows, windowed_rows, sizes, asked, whole, counts

    whole_rows, windowed_rows, sizes, asked, whole, counts = asyncio.run(go())
    assert sizes == [800, 800, 130, 301]
    torch.testing.assert_close(windowed_rows, whole_rows, rtol=0, atol=1e-5 * float(whole_rows.abs().max()))
    assert counts == (2, 1)
    assert [o.data["token_ids"].tolist() for o in asked] == [o.data["token_ids"].tolist() for o in whole]
    for name, value in whole[0].data.items():
        torch.testing.assert_close(asked[0].data[name], value, rtol=0, atol=1e-4, msg=name)
