"""Qwen2.5-Omni's three stages, driven directly (no processes) and fed window by window as the
pipeline feeds them, against the reference: transformers' own
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` on the same tiny
checkpoint, same prompt, greedy."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import io
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from torch._dynamo.utils import counters

from omni_gateway.media import decode_media
from omni_pipeline.sampling import Sampling
from omni_pipeline.settings import MediaSpec
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import CallState, Engine, EngineCall, EngineError, InvalidRequest
from omni_stage.models.qwen2_5_omni.checkpoint import CODEC_VOCAB
from omni_stage.payload import Payload, concat
from omni_stage.segments import EngineOutput
from tests.helpers import COMPILE_TIMEOUT_S, ROOT, asked_while_held, example_stage, wait_until
from tests.qwen_reference import (
    PREFILL_QUESTIONS,
    check_a_bounded_talker,
    check_first_audio_under_load,
    check_prompts_prefilled_together,
    check_talker_prompts_prefilled_together,
    counts_uncompiled,
    cut_while_speaking,
    media_clips,
    media_message,
    reference_generate,
    reference_with_media,
    reference_with_video,
    slot_table,
    video_clip,
    video_message,
    windows,
)

EXAMPLE = ROOT / "examples" / "qwen2.5-omni.yaml"
EPD = ROOT / "examples" / "qwen2.5-omni-epd.yaml"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
THINKER_TOKENS, TALKER_CODES, SEED = 12, 40, 7


def engine(stage: str, model: Path, **args: Any) -> Engine:
    return example_stage(EPD if stage == "encoder" else EXAMPLE, stage, model, **args)


async def run_pipeline(
    model: Path,
    voice: str,
    thinker_window: int,
    messages: list[dict[str, Any]] = MESSAGES,
    thinker: Engine | None = None,
    encoder: Engine | None = None,
    extra: dict[str, Any] | None = None,
    talker: Engine | None = None,
) -> dict[str, Any]:
    """The three stages, code2wav on the whole code sequence (as the reference decodes it).
    `messages` as a client sends them: media parts are decoded by the gateway's own code.
    `thinker`: one already started (the vLLM thinker's test); else the example's. `encoder`:
    an encoder stage (started) whose output the thinker reads beside the request. `extra`: more
    of the request's sampling (what the source stages read; the talker its `prompt_cache_key`).
    `talker`: one already started (a conversation's, across turns)."""
    code2wav = engine("code2wav", model, chunkCodes=0)
    if thinker is None:
        thinker = engine("thinker", model)
        await thinker.start()
    if talker is None:
        talker = engine("talker", model)
        await talker.start()
    await code2wav.start()
    assert talker.prompt_caches is not None
    reused_before = talker.prompt_caches.reused_tokens
    messages, media = await decode_media(messages, MediaSpec())
    request = {"messages": messages, "media": media.tensors, "modalities": ["audio", "text"], "voice": voice}
    sampling = {"max_tokens": THINKER_TOKENS, "voice": voice, "seed": SEED, **(extra or {})}
    inputs: dict[str, Payload] = {"request": request}
    if encoder is not None:  # which reads the media; the thinker gets the messages alone (media: false)
        encoded = [
            o
            async for o in encoder.generate(
                EngineCall("r", {"request": request}, True, Sampling.of(sampling))
            )
        ]
        inputs = {"request": request | {"media": {}}, "encoder": concat([o.data for o in encoded])}
    thinking = EngineCall("r", inputs, True, Sampling.of(sampling))
    thought = [o async for o in thinker.generate(thinking)]
    state = CallState()
    codes: list[EngineOutput] = []
    for payload, last in windows(thought, thinker_window):
        talking = {"max_tokens": TALKER_CODES, "voice": voice}
        talking |= {k: v for k, v in (extra or {}).items() if k == "prompt_cache_key"}
        talk = EngineCall("r", {"thinker": payload}, last, Sampling.of(talking), state)
        codes += [o async for o in talker.generate(talk)]
    code_data = concat([o.data for o in codes])
    wav_call = EngineCall("r", {"talker": code_data}, True, Sampling(voice=voice, seed=SEED))
    audio = [o async for o in code2wav.generate(wav_call)]
    return {
        "tokens": torch.cat([o.data["token_ids"] for o in thought]),
        "text": "".join(o.text for o in thought),
        "codes": code_data["codes"],
        "audio": audio[0].data["audio"],
        "cached_tokens": thinking.state.cached_tokens,
        "prompt_hidden": thought[0].data["prompt_hidden"],
        "talker_reused": talker.prompt_caches.reused_tokens - reused_before,
    }


WAVEFORM_ATOL = 1e-5
"""float32, the same operations in the same order on the same noise: any difference is summation order."""


@pytest.fixture(scope="module")
def model(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-qwen2.5-omni"


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, Any]:
    return reference_generate(model, MESSAGES, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")


@pytest.mark.parametrize(
    ("thinker_window", "fixed"), [(1, False), (4, False), (1000, False), (4, True)], ids=str
)
def test_the_stages_compute_what_the_reference_computes(
    model: Path, reference: dict[str, Any], thinker_window: int, fixed: bool
) -> None:
    """Text token for token, codes code for code. The waveform within 1e-5 (float32, the same
    operations in the same order on the same noise: any difference is summation order). So
    with the thinker and the talker each stepping on its slot table at fixed shapes
    (`fixedSteps`: what `cudaGraphs` replays on CUDA)."""

    async def go() -> dict[str, Any]:
        if not fixed:
            return await run_pipeline(model, "Ethan", thinker_window)
        thinker, talker = await started(
            engine("thinker", model, fixedSteps=True), engine("talker", model, fixedSteps=True)
        )
        return await run_pipeline(model, "Ethan", thinker_window, thinker=thinker, talker=talker)

    ours = asyncio.run(go())
    assert ours["tokens"].tolist() == reference["tokens"].tolist()
    assert ours["text"] == reference["text"] and len(ours["tokens"]) == THINKER_TOKENS
    assert ours["codes"].tolist() == reference["codes"].tolist()
    assert len(ours["codes"]) > 8
    assert ours["audio"].shape == reference["audio"].shape == (len(ours["codes"]) * 480,)
    # A real waveform, far above the tolerance it is compared within (not a silent one).
    assert float(reference["audio"].std()) > 100 * WAVEFORM_ATOL
    torch.testing.assert_close(ours["audio"], reference["audio"], rtol=0, atol=WAVEFORM_ATOL)


def test_a_talker_bounded_by_max_model_len_speaks_the_references_first_codes(
    model: Path, reference: dict[str, Any]
) -> None:
    """The talker at fixed shapes with `maxModelLen`: a prompt past it refused, a bound past
    the prompt the reference's first codes (check_a_bounded_talker)."""

    async def go(bound: int) -> dict[str, Any]:
        (talker,) = await started(engine("talker", model, fixedSteps=True, maxModelLen=bound))
        return await run_pipeline(model, "Ethan", 4, talker=talker)

    check_a_bounded_talker(lambda bound: asyncio.run(go(bound)), reference)


def test_the_voice_changes_the_speech(model: Path, reference: dict[str, Any]) -> None:
    """Chelsie against the reference's Ethan: a difference far above the parity tolerance
    (random weights make it small: about 1.5e-4 on a waveform of std 0.006)."""
    other = asyncio.run(run_pipeline(model, "Chelsie", 4))
    n = min(len(other["audio"]), len(reference["audio"]))
    diff = float((other["audio"][:n] - reference["audio"][:n]).abs().max())
    assert diff > 10 * WAVEFORM_ATOL


def test_an_unknown_voice_is_refused_before_any_work(model: Path) -> None:
    with pytest.raises(
        InvalidRequest, match="voice 'alloy' is not one of this model's voices: Chelsie, Ethan"
    ):
        asyncio.run(run_pipeline(model, "alloy", 4))


async def decode_in_chunks(
    model: Path, codes: torch.Tensor, window: int, **args: Any
) -> tuple[list[torch.Tensor], int]:
    """code2wav fed `window` codes a call, as the talker's edge feeds it; its audio chunks, and
    the frames its DiT solved. Nothing is compiled once it has started (`compile` compiles
    at start)."""
    code2wav = engine("code2wav", model, **args)
    await code2wav.start()
    graphs = counters["stats"]["unique_graphs"]
    state = CallState()
    chunks = []
    for i in range(0, len(codes), window):
        last = i + window >= len(codes)
        call = EngineCall(
            "r", {"talker": {"codes": codes[i : i + window]}}, last, Sampling(voice="Ethan", seed=SEED), state
        )
        chunks += [o.data["audio"] async for o in code2wav.generate(call)]
    assert counters["stats"]["unique_graphs"] == graphs
    return chunks, code2wav.dit.frames_solved  # type: ignore[attr-defined]


@pytest.mark.parametrize("longest", [12, 48])
def test_audio_decoded_in_chunks_equals_the_whole_decode_and_solves_each_frame_once(
    model: Path, reference: dict[str, Any], longest: int
) -> None:
    """Chunks of 12 codes (one DiT block), or growing from 12 to as long as the audio before
    them (up to `maxChunkCodes`), each solved with the 12 codes after it and reading what the
    request kept of the chunk before (its look-back layers' inputs at every evaluation,
    BigVGAN's last 10 codes of mel): the same length, and within 1e-6 of the whole decode on
    this checkpoint (measured: 7e-8, an SNR of 136 dB). Nothing before a chunk is solved
    again: the DiT solves each frame once, and each chunk's right context once more. Without
    context a chunk is far off (30 dB)."""
    codes = reference["codes"]
    chunks, solved = asyncio.run(decode_in_chunks(model, codes, 12, chunkCodes=12, maxChunkCodes=longest))
    sizes, done = [], 0
    while done < len(codes):
        sizes.append(min(max(done, 12), longest, len(codes) - done))
        done += sizes[-1]
    assert [len(c) // 480 for c in chunks] == sizes and len(sizes) > 2  # 480 samples a code
    audio = torch.cat(chunks)
    assert audio.shape == reference["audio"].shape
    torch.testing.assert_close(audio, reference["audio"], rtol=0, atol=1e-6)
    repeats = 2  # DiT frames a code
    assert solved <= (len(codes) + 12 * (len(sizes) - 1)) * repeats, solved
    blind, _ = asyncio.run(
        decode_in_chunks(model, codes, 12, chunkCodes=12, leftContextCodes=0, rightContextCodes=0)
    )
    assert float((torch.cat(blind) - reference["audio"]).abs().max()) > 1e-2


def test_what_the_thinker_cannot_read_is_the_clients_error_and_a_one_token_reply_speaks_nothing(
    model: Path,
) -> None:
    async def go() -> None:
        thinker, talker = engine("thinker", model), engine("talker", model)
        await thinker.start()
        await talker.start()
        refused = {
            "this model cannot read the 'file' part": [{"type": "file", "media": "m0"}],
            "the messages contain the model's special token <\\|AUDIO\\|>": "hear <|AUDIO|>",
        }
        for why, content in refused.items():
            request = {"messages": [{"role": "user", "content": content}], "media": {}}
            with pytest.raises(InvalidRequest, match=why):
                [o async for o in thinker.generate(EngineCall("a", {"request": request}, True, Sampling()))]
        call = EngineCall("b", {"request": {"messages": MESSAGES}}, True, Sampling(max_tokens=1))
        one = [o async for o in thinker.generate(call)]
        talk = EngineCall("b", {"thinker": concat([o.data for o in one])}, True, Sampling(voice="Ethan"))
        assert [o async for o in talker.generate(talk)] == []

    asyncio.run(go())


@pytest.mark.parametrize("cut", [1, 5])
def test_a_stop_string_ends_the_reply_before_it(model: Path, reference: dict[str, Any], cut: int) -> None:
    """OpenAI's `stop`: the text ends just before the first stop string, finish_reason stop;
    the text streamed before it is exactly the reference's up to there."""
    stop = reference["text"][cut : cut + 2]

    async def go() -> list[EngineOutput]:
        thinker = engine("thinker", model)
        await thinker.start()
        sampling = {"max_tokens": THINKER_TOKENS, "stop": ["never", stop]}
        call = EngineCall("s", {"request": {"messages": MESSAGES}}, True, Sampling.of(sampling))
        return [o async for o in thinker.generate(call)]

    out = asyncio.run(go())
    assert "".join(o.text for o in out) == reference["text"][: reference["text"].index(stop)]
    assert out[-1].finish_reason == "stop" and len(out) < THINKER_TOKENS


def test_the_thinker_honours_logit_bias_and_logprobs_as_its_reference(
    model: Path, reference: dict[str, Any]
) -> None:
    """The thinker picks with the step-loop engines' sampler: a logit bias is the reference
    thinker's `generate(..., sequence_bias=...)`, logprobs the log-softmax of its raw logits."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    banned = int(reference["tokens"][2])
    sampling = {
        "max_tokens": THINKER_TOKENS,
        "logit_bias": {str(banned): -100},
        "logprobs": True,
        "top_logprobs": 3,
    }

    async def go() -> list[EngineOutput]:
        thinker = engine("thinker", model)
        await thinker.start()
        call = EngineCall("b", {"request": {"messages": MESSAGES}}, True, Sampling.of(sampling))
        return [o async for o in thinker.generate(call)]

    out = asyncio.run(go())
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), return_tensors="pt"
    )
    thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(model).thinker.eval()
    ref = thinker.generate(
        ids["input_ids"],
        max_new_tokens=THINKER_TOKENS,
        do_sample=False,
        sequence_bias={(banned,): -100.0},
        output_logits=True,
        return_dict_in_generate=True,
    )
    ref_tokens = ref.sequences[0, ids["input_ids"].shape[1] :].tolist()
    ours = [int(o.data["token_ids"][0]) for o in out]
    assert ours == ref_tokens != reference["tokens"].tolist() and banned not in ours
    raw = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
    got = [lp for o in out for lp in o.logprobs]
    assert [g.token for g in got] == [tok.decode([t]) for t in ours[: len(got)]]
    assert [g.logprob for g in got] == pytest.approx(
        [float(raw[i][t]) for i, t in enumerate(ours[: len(got)])], abs=1e-4
    )
    assert [[t for t, _ in g.top] for g in got] == [
        [tok.decode([t]) for t in torch.topk(raw[i], 3).indices.tolist()] for i in range(len(got))
    ]


@pytest.fixture(scope="module")
def media_reference(model: Path) -> dict[str, Any]:
    return reference_with_media(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")


@pytest.mark.parametrize("thinker_window", [1, 1000])
def test_with_audio_and_an_image_the_stages_compute_what_the_reference_computes(
    model: Path, reference: dict[str, Any], media_reference: dict[str, Any], thinker_window: int
) -> None:
    """The same, with an audio clip and an image in the message (decoded by the gateway's
    code, prompt and features built by the thinker, which the reference builds with the
    model's processor): text, codes and waveform as above, and not the text-only answer."""
    ours = asyncio.run(run_pipeline(model, "Ethan", thinker_window, [media_message(*media_clips())]))
    assert ours["tokens"].tolist() == media_reference["tokens"].tolist()
    assert ours["tokens"].tolist() != reference["tokens"].tolist()
    assert ours["codes"].tolist() == media_reference["codes"].tolist()
    assert ours["audio"].shape == media_reference["audio"].shape
    torch.testing.assert_close(ours["audio"], media_reference["audio"], rtol=0, atol=1e-5)


def test_mm_processor_kwargs_reach_the_processors_as_in_the_reference(
    model: Path, media_reference: dict[str, Any]
) -> None:
    """vLLM's `mm_processor_kwargs` (here a minimum pixel count that scales the image up): the
    thinker's processors get them as the model's processor does when vLLM passes them, with or
    without an encoder stage; the reply is the reference's with them, not the one without. A
    key the processors here do not take is the client's error."""
    bigger = {"min_pixels": 20000}
    theirs = reference_with_media(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan", bigger)
    message = [media_message(*media_clips())]
    ours = asyncio.run(run_pipeline(model, "Ethan", 1000, message, extra={"mm_processor_kwargs": bigger}))
    assert ours["tokens"].tolist() == theirs["tokens"].tolist() != media_reference["tokens"].tolist()

    async def with_encoder() -> dict[str, Any]:
        encoder = engine("encoder", model)
        await encoder.start()
        return await run_pipeline(
            model, "Ethan", 1000, message, encoder=encoder, extra={"mm_processor_kwargs": bigger}
        )

    assert asyncio.run(with_encoder())["tokens"].tolist() == theirs["tokens"].tolist()
    with pytest.raises(
        InvalidRequest, match=r"mm_processor_kwargs\.fps: not taken by this model's processors"
    ):
        asyncio.run(run_pipeline(model, "Ethan", 1000, message, extra={"mm_processor_kwargs": {"fps": 2}}))


def test_with_a_video_the_stages_compute_what_the_reference_computes(
    model: Path, reference: dict[str, Any]
) -> None:
    """The same with a video: the gateway's code takes 2 frames a second of the 4 fps clip,
    the thinker runs the model's video processor on them and places them in time; the
    reference gets the same frames through the model's processor."""
    ours = asyncio.run(run_pipeline(model, "Ethan", 4, [video_message(video_clip()[0])]))
    theirs = reference_with_video(model, THINKER_TOKENS, TALKER_CODES, SEED, "Ethan")
    assert ours["tokens"].tolist() == theirs["tokens"].tolist()
    assert ours["tokens"].tolist() != reference["tokens"].tolist()
    assert ours["codes"].tolist() == theirs["codes"].tolist()
    assert ours["audio"].shape == theirs["audio"].shape
    torch.testing.assert_close(ours["audio"], theirs["audio"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocode", [None, 1])
def test_concurrent_requests_decode_in_one_batch_with_the_same_audio(
    model: Path, reference: dict[str, Any], media_reference: dict[str, Any], vocode: int | None
) -> None:
    """Four requests (two code sequences, three seeds) fed to one code2wav replica at once,
    in chunks: the chunks of the same length and voice are decoded together (all four, once
    the first, which ran at once, is done), and every request's audio is what it is decoded
    alone (within 1e-6: a batched matmul may sum in another order). With `maxVocodeBatch: 1`
    the solver's steps still go four at once, BigVGAN takes each chunk alone, and the audio
    is the same."""

    async def go() -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        args = {} if vocode is None else {"maxVocodeBatch": vocode}
        # Every first chunk 12 codes, however busy (the load's sizing: the test after this one).
        code2wav = engine("code2wav", model, chunkCodes=12, busyFirstChunkCodes=12, **args)
        await code2wav.start()
        jobs = [
            (reference["codes"], 1),
            (media_reference["codes"], 1),
            (reference["codes"], 2),
            (media_reference["codes"], 3),
        ]

        async def decode(codes: torch.Tensor, seed: int) -> torch.Tensor:
            call = EngineCall(
                f"r{seed}{len(codes)}",
                {"talker": {"codes": codes}},
                True,
                Sampling(voice="Ethan", seed=seed),
            )
            return [o.data["audio"] async for o in code2wav.generate(call)]

        together = await asyncio.gather(*(decode(c, s) for c, s in jobs))
        batched = code2wav.batcher.batch_sizes.copy()  # type: ignore[attr-defined]
        alone = [torch.cat(await decode(c, s)) for c, s in jobs]
        if vocode == 1:  # every chunk vocoded alone
            assert batched[1] >= sum(len(chunks) for chunks in together), batched
        return [torch.cat(chunks) for chunks in together], alone, batched

    together, alone, batched = asyncio.run(go())
    assert max(batched) == 4, batched
    for a, b in zip(together, alone, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("one_compile_at_a_time")
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
@pytest.mark.parametrize("form", ["eager", "compiled", "fixed"])
def test_concurrent_requests_think_and_talk_in_batched_steps_with_the_same_output(
    model: Path, form: str
) -> None:
    """Three requests of different prompt lengths (one with audio and an image) on one thinker
    and one talker replica at once (asked while the thinker's compute thread is held, so that
    each has its media decoded, its prompt built and its first step queued before any runs;
    else a slow build of the media prompt let the first end its tokens alone under load): their
    decode steps run as batches (the thinker's caches
    stacked, left-padded, masked; the talker's in its slot table, each step written in place:
    a request's cache is copied once, into its slot at its prefill, never at a step, and its
    slot given back at its end), and each request's tokens and codes are exactly those it
    gets alone. A talker with `compile: true` (torch.compile of its decoder layers, here
    inductor on this CPU) speaks the same codes, together and alone, as one not compiled; so
    does one with `fixedSteps: true` (every step at a bucket's fixed shapes, over the table's
    whole length: what `cudaGraphs` captures on CUDA), and a thinker with it (on a slot table
    too, copied into once a request) thinks the same tokens as one on its own caches."""
    compiled = form == "compiled"
    args = {"compiled": {"compile": True}, "fixed": {"fixedSteps": True}}.get(form, {})
    thinker_args = {"fixedSteps": True, "maxModelLen": 256} if form == "fixed" else {}
    requests = [
        MESSAGES,
        [media_message(*media_clips())],
        [{"role": "user", "content": "A much longer question, to make the prompts differ in length: why?"}],
    ]

    Spoken = list[tuple[list[int], list[int]]]

    async def go() -> tuple[Spoken, Spoken, Spoken, Any, Any]:
        thinker, talker, eager = (
            engine("thinker", model, **thinker_args),
            engine("talker", model, **args),
            None,
        )
        await thinker.start()
        own_thinker = thinker
        before = counters["stats"]["unique_graphs"]
        await talker.start()
        graphs = counters["stats"]["unique_graphs"]  # what torch.compile has compiled so far
        assert (graphs > before) == compiled  # the talker's forms compiled at its start
        if args:
            eager = engine("talker", model)
            await eager.start()
        if thinker_args:
            own_thinker = engine("thinker", model)
            await own_thinker.start()

        async def speak(
            messages: list[dict[str, Any]], on: Engine = talker, by: Engine = thinker
        ) -> tuple[list[int], list[int]]:
            messages, media = await decode_media(messages, MediaSpec())
            request = {"messages": messages, "media": media.tensors, "modalities": ["audio", "text"]}
            call = EngineCall(
                "r", {"request": request}, True, Sampling(max_tokens=THINKER_TOKENS, voice="Ethan")
            )
            thought = [o async for o in by.generate(call)]
            data = concat([o.data for o in thought])
            talk = EngineCall("r", {"thinker": data}, True, Sampling(max_tokens=TALKER_CODES, voice="Ethan"))
            codes = [o async for o in on.generate(talk)]
            return data["token_ids"].tolist(), concat([o.data for o in codes])["codes"].tolist()

        copies, _, keys = slot_table(talker)
        decoder = talker.model.model  # type: ignore[attr-defined]
        uncompiled: list[tuple[int, ...]] = []
        counting = counts_uncompiled(decoder, uncompiled)
        together = await asked_while_held(thinker, thinker.batcher, [speak(m) for m in requests])  # type: ignore[attr-defined]
        sizes = (thinker.batcher.batch_sizes.copy(), talker.batcher.batch_sizes.copy())  # type: ignore[attr-defined]
        alone = [await speak(m) for m in requests]
        assert slot_table(talker) == (copies + 2 * len(requests), 0, keys)
        if thinker_args:
            assert slot_table(thinker)[1] == 0  # (no slot held)
        counting.remove()
        not_compiled = alone if eager is None else [await speak(m, eager, own_thinker) for m in requests]
        assert hasattr(decoder, "_orig_mod") == compiled
        assert counters["stats"]["unique_graphs"] == graphs  # compiled at start: none since
        if compiled:  # and the requests' forwards ran what was compiled (none past Dynamo's limit)
            assert uncompiled == [], uncompiled
        return together, alone, not_compiled, *sizes

    together, alone, not_compiled, thinker_batches, talker_batches = asyncio.run(go())
    assert max(thinker_batches) == 3 and max(talker_batches) >= 2, (thinker_batches, talker_batches)
    assert together == alone == not_compiled


@pytest.mark.parametrize(
    ("args", "batched"),
    [
        ({"prefillBatchTokens": 2048}, True),
        ({"prefillBatchTokens": 2048, "fixedSteps": True, "maxModelLen": 256}, True),
        ({}, False),
    ],
    ids=["own caches", "slot table", "the default on a CPU"],
)
def test_prompts_of_text_queued_together_are_prefilled_together_as_each_alone(
    model: Path, args: dict[str, Any], batched: bool
) -> None:
    """On the thinker's own caches and on its slot table (`fixedSteps`): one forward for the
    prompts queued behind a prefill, each request thinking what it thinks alone
    (check_prompts_prefilled_together); by default on a CPU (where a prefill is
    compute-bound), each alone. A budget that is not a whole number is refused when the stage
    is built."""
    check_prompts_prefilled_together(
        engine("thinker", model, **args), PREFILL_QUESTIONS, THINKER_TOKENS, batched
    )
    with pytest.raises(EngineError, match="prefillBatchTokens must be a whole number, 0 or more, got -1"):
        engine("thinker", model, prefillBatchTokens=-1)


@pytest.mark.parametrize("args", [{}, {"fixedSteps": True}], ids=["own shapes", "fixed shapes"])
def test_talker_prompts_queued_together_are_prefilled_together_as_each_alone(
    model: Path, args: dict[str, Any]
) -> None:
    """The talker's prompts that queue behind a prefill go in one forward, each request
    speaking the codes it speaks alone (check_talker_prompts_prefilled_together), its decode
    steps on the slot table's own shapes or at fixed shapes."""
    check_talker_prompts_prefilled_together(
        engine("thinker", model),
        engine("talker", model, prefillBatchTokens=2048, **args),
        PREFILL_QUESTIONS,
        TALKER_CODES,
    )


def test_a_prompt_refused_in_a_batch_of_prefills_leaves_the_others_thinking_as_alone(model: Path) -> None:
    """The longest of three prompts asked with constraints that leave no first token, the
    batch's prompts each a forward of its own (`prefillBatchTokens` 1: the batch's forwards
    all run before any token is picked): that request is refused, and the batch it fails,
    run again a prompt at a time, leaves the others thinking what they think alone."""
    check_prompts_prefilled_together(
        engine("thinker", model, prefillBatchTokens=1), PREFILL_QUESTIONS, THINKER_TOKENS, refused=1
    )


def test_a_talkers_slot_is_given_back_however_its_request_ends(model: Path) -> None:
    """A talker request holds a slot of the replica's cache from its prefill to its end. Ended
    between its calls (it spoke what the thinker had sent, and waits for more), or cut while
    its step runs, the slot is given back when the stage's runner says the request ended
    (`request_ended`, called here as the runner calls it), once the step in progress is over;
    the replica's gauge of what it holds (`active_requests`) says so."""

    async def go() -> None:
        thinker, talker = engine("thinker", model), engine("talker", model)
        await thinker.start()
        await talker.start()
        request = {"messages": MESSAGES, "modalities": ["audio", "text"]}
        call = EngineCall("r", {"request": request}, True, Sampling(max_tokens=THINKER_TOKENS))
        thought = concat([o.data async for o in thinker.generate(call)])
        sampling = Sampling(max_tokens=TALKER_CODES, voice="Ethan")

        waiting = EngineCall("w", {"thinker": thought}, False, sampling)  # more was to come
        codes = [o async for o in talker.generate(waiting)]
        assert codes and talker.active_requests() == 1
        talker.request_ended(waiting.state)
        await wait_until(lambda: talker.active_requests() == 0, 30, "the waiting request's slot back")

        await cut_while_speaking(talker, EngineCall("c", {"thinker": thought}, True, sampling))

    asyncio.run(go())


async def started(*engines: Engine) -> tuple[Engine, ...]:
    for e in engines:
        await e.start()
    return engines


@pytest.mark.parametrize("media", ["audio and image", "video"])
def test_with_an_encoder_stage_the_pipeline_computes_the_same(
    model: Path, media_reference: dict[str, Any], media: str
) -> None:
    """The thinker fed the encoder stage's embeddings in place of the media (which it does not
    get: `media: false`) gives the tokens and codes it gives running its own encoders, which
    are the reference's; and it reads them: the same request with the embeddings zeroed
    answers otherwise. Given neither, it says so."""
    message = media_message(*media_clips()) if media != "video" else video_message(video_clip()[0])

    async def go() -> tuple[dict[str, Any], dict[str, Any], list[int], dict[str, Any]]:
        encoder, thinker = await started(engine("encoder", model), engine("thinker", model))
        split = await run_pipeline(model, "Ethan", 4, [message], thinker=thinker, encoder=encoder)
        whole = await run_pipeline(model, "Ethan", 4, [message], thinker=thinker)
        messages, decoded = await decode_media([message], MediaSpec())
        request = {"messages": messages, "media": decoded.tensors}
        sampling = {"max_tokens": THINKER_TOKENS}
        encoded = concat(
            [
                o.data
                async for o in encoder.generate(
                    EngineCall("e", {"request": request}, True, Sampling.of(sampling))
                )
            ]
        )
        zeroed = {k: torch.zeros_like(v) if k.endswith("_embeds") else v for k, v in encoded.items()}
        call = EngineCall("z", {"request": request, "encoder": zeroed}, True, Sampling.of(sampling))
        blind = torch.cat([o.data["token_ids"] async for o in thinker.generate(call)]).tolist()
        bare = EngineCall("b", {"request": request | {"media": {}}}, True, Sampling.of(sampling))
        with pytest.raises(EngineError, match="came without its data"):
            [o async for o in thinker.generate(bare)]
        return split, whole, blind, encoded

    split, whole, blind, encoded = asyncio.run(go())
    kinds = {"audio", "image"} if media != "video" else {"video"}
    assert {k.removesuffix("_embeds") for k in encoded if k.endswith("_embeds")} == kinds
    assert split["tokens"].tolist() == whole["tokens"].tolist()
    assert split["codes"].tolist() == whole["codes"].tolist()
    torch.testing.assert_close(split["audio"], whole["audio"], rtol=0, atol=1e-5)
    if media != "video":
        assert split["tokens"].tolist() == media_reference["tokens"].tolist()
    assert blind != split["tokens"].tolist()


def _clip(seed: int) -> dict[str, Any]:
    """A user turn with a 1 s tone in noise of its own (the same length whatever the seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(16000) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * (300 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(
        np.float32
    )
    wav = io.BytesIO()
    soundfile.write(wav, pcm, 16000, format="WAV", subtype="FLOAT")
    audio = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"},
    }
    return {"role": "user", "content": [audio, {"type": "text", "text": "And now?"}]}


@pytest.mark.parametrize("encoder_stage", [False, True], ids=["own encoders", "encoder stage"])
def test_a_conversation_kept_by_its_prompt_cache_key_answers_as_a_whole_prefill(
    model: Path, encoder_stage: bool
) -> None:
    """Turn 2 of a conversation (turn 1's audio, image and question, its answer, a new clip):
    with turn 1's `prompt_cache_key` the thinker reuses turn 1's sequence (its answer included)
    and the talker turn 1's prompt positions, each computes only the rest, and they think,
    talk and speak what they do with no key (the
    whole prefill, which the tests above hold to the reference). Turn 2 asked again with
    another clip of the same length (the same placeholder tokens, other sound) reuses turn 2's
    sequence only up to the clip: it answers as its whole prefill does, and the states the
    talker reads are not those of the first clip."""
    first = media_message(*media_clips())

    async def go() -> tuple[dict[str, Any], ...]:
        encoder = (await started(engine("encoder", model)))[0] if encoder_stage else None
        thinker, talker = await started(engine("thinker", model), engine("talker", model))
        key = {"prompt_cache_key": "conversation-1"}
        turn1 = await run_pipeline(model, "Ethan", 4, [first], thinker, encoder, key, talker)
        second = [first, {"role": "assistant", "content": turn1["text"]}, _clip(1)]
        kept = await run_pipeline(model, "Ethan", 4, second, thinker, encoder, key, talker)
        whole = await run_pipeline(model, "Ethan", 4, second, thinker, encoder, talker=talker)
        other = [*second[:2], _clip(2)]
        other_kept = await run_pipeline(model, "Ethan", 4, other, thinker, encoder, key, talker)
        other_whole = await run_pipeline(model, "Ethan", 4, other, thinker, encoder, talker=talker)
        return turn1, kept, whole, other_kept, other_whole

    turn1, kept, whole, other_kept, other_whole = asyncio.run(go())
    assert turn1["cached_tokens"] == 0 and whole["cached_tokens"] == 0
    assert kept["cached_tokens"] > 0
    # The talker too: turn 1's prompt positions, fed the thinker's kept rows, are not fed again.
    assert turn1["talker_reused"] == 0 and whole["talker_reused"] == 0
    assert 0 < kept["talker_reused"] <= kept["cached_tokens"]
    assert kept["tokens"].tolist() == whole["tokens"].tolist()
    assert kept["codes"].tolist() == whole["codes"].tolist()
    torch.testing.assert_close(kept["audio"], whole["audio"], rtol=0, atol=WAVEFORM_ATOL)
    assert kept["cached_tokens"] < other_kept["cached_tokens"]  # turn 2's prompt, up to the clip
    assert other_kept["tokens"].tolist() == other_whole["tokens"].tolist()
    assert other_kept["codes"].tolist() == other_whole["codes"].tolist()
    # What the talker reads of the prompt: as the whole prefill computes it, not the first clip's.
    torch.testing.assert_close(other_kept["prompt_hidden"], other_whole["prompt_hidden"], rtol=0, atol=1e-4)
    assert not torch.allclose(other_whole["prompt_hidden"], whole["prompt_hidden"], rtol=0, atol=1e-2)


@pytest.mark.parametrize("slots", [False, True], ids=["own caches", "slot table"])
def test_a_response_cut_short_leaves_its_sequence_for_the_next_turn(model: Path, slots: bool) -> None:
    """A barge-in: turn 1 closed after three tokens (its task cancelled) leaves the sequence it
    had made, once its step in progress has ended; turn 2, whose assistant turn is the text
    sent so far, reuses it and answers as its whole prefill does. A thinker on a slot table
    (`fixedSteps`) copies the sequence out of the cut request's slot, and gives the slot back
    when the stage's runner says the request ended (`request_ended`, called here as the runner
    calls it); the turns after give theirs back as they complete."""
    first = media_message(*media_clips())
    args = {"fixedSteps": True, "maxModelLen": 256} if slots else {}

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        thinker, talker = await started(engine("thinker", model, **args), engine("talker", model))
        assert thinker.prompt_caches is not None
        messages, media = await decode_media([first], MediaSpec())
        call = EngineCall(
            "r",
            {"request": {"messages": messages, "media": media.tensors}},
            True,
            Sampling(max_tokens=50, prompt_cache_key="c"),
        )
        said: list[str] = []
        three = asyncio.Event()

        async def listen() -> None:  # as the stage's runner reads an engine's outputs
            async with contextlib.aclosing(thinker.generate(call)) as outs:
                async for o in outs:
                    said.append(o.text)
                    if len(said) == 3:
                        three.set()
                        await asyncio.Event().wait()  # the client stops listening here

        task = asyncio.create_task(listen())
        async with asyncio.timeout(30):
            await three.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        thinker.request_ended(call.state)
        await wait_until(lambda: len(thinker.prompt_caches) == 1, 10, "the cut sequence kept")
        await wait_until(lambda: thinker.active_requests() in (None, 0), 10, "the cut request's slot back")
        second = [first, {"role": "assistant", "content": "".join(said)}, _clip(1)]
        key = {"prompt_cache_key": "c"}
        kept = await run_pipeline(model, "Ethan", 4, second, thinker, None, key, talker)
        whole = await run_pipeline(model, "Ethan", 4, second, thinker, None, talker=talker)
        assert thinker.active_requests() == (0 if slots else None)
        return kept, whole

    kept, whole = asyncio.run(go())
    assert kept["cached_tokens"] > 0
    assert kept["tokens"].tolist() == whole["tokens"].tolist()
    assert kept["codes"].tolist() == whole["codes"].tolist()


def test_the_encoder_stage_encodes_requests_together_as_each_alone(model: Path) -> None:
    """Three requests' media (audio and an image, a video, a shorter clip and an image) through the
    encoder stage's towers in one batch, as concurrent requests reach them (its StepBatcher
    groups them, tests/unit/test_batching.py): each request's embeddings and layout are
    those it gets alone (within 1e-6: a longer matmul may sum in another order). A request
    without media gets nothing from the stage."""
    wav, png = media_clips()
    shorter = io.BytesIO()  # another length: each request's features span its own clips
    soundfile.write(
        shorter, np.sin(np.arange(11200) / 9.0).astype(np.float32), 16000, format="WAV", subtype="FLOAT"
    )
    requests = [
        [media_message(wav, png)],
        [video_message(video_clip()[0])],
        [media_message(shorter.getvalue(), png)],
    ]

    from omni_stage.models.qwen_omni.encoder import Encoding

    async def go() -> tuple[list[Payload], list[Payload], list[EngineOutput]]:
        (encoder,) = await started(engine("encoder", model))
        inputs = []
        for messages in requests:
            messages, media = await decode_media(messages, MediaSpec())
            prompts = encoder.prompts  # type: ignore[attr-defined]
            processed = prompts.process(prompts.read({"messages": messages, "media": media.tensors}))
            inputs.append(Encoding(processed, {}))  # no live session's audio encoded ahead
        together = [e.to_payload() for e in encoder._encode(inputs)]  # type: ignore[attr-defined]
        # What sleep frees is the two towers; woken, it encodes as before.
        assert encoder.weight_bytes()["cpu"] > 0
        await encoder.sleep(2)
        assert encoder.weight_bytes() == {}
        await encoder.wake_up(2)
        alone = [encoder._encode([i])[0].to_payload() for i in inputs]  # type: ignore[attr-defined]
        text = EngineCall("t", {"request": {"messages": MESSAGES, "media": {}}}, True, Sampling())
        return together, alone, [o async for o in encoder.generate(text)]

    together, alone, nothing = asyncio.run(go())
    assert nothing == []
    assert [sorted(p) for p in together] == [
        ["audio_embeds", "audio_lengths", "image_embeds", "image_grid_thw"],
        ["video_embeds", "video_grid_thw", "video_second_per_grid"],
        ["audio_embeds", "audio_lengths", "image_embeds", "image_grid_thw"],
    ]
    for a, b in zip(together, alone, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            # Within float32 rounding of the batched forward (padded to the batch's longest clip):
            # 1e-5 of the tensor's largest value, since the rounding grows with the values (the
            # audio tower's, drawn wider for input sensitivity, reach ~5); layouts are equal.
            scale = float(b[k].abs().max()) if b[k].is_floating_point() and b[k].numel() else 0.0
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5 * scale)


def test_audio_features_equal_the_processors_on_every_frame_the_encoder_reads(model: Path) -> None:
    """The thinker's (and the encoder stage's) log-mel features for clips of several lengths
    at once, a silent one and one of a single sample among them, equal bit for bit what
    `Qwen2_5OmniProcessor` computes in its 300 s window, on every frame its mask keeps; and
    the masks keep the same frames."""
    from transformers import AutoTokenizer, Qwen2_5OmniConfig

    from omni_stage.models.qwen_omni.prompt import Prompts
    from tests.qwen_reference import reference_processor

    config = Qwen2_5OmniConfig.from_pretrained(model).thinker_config
    prompts = Prompts(
        str(model), AutoTokenizer.from_pretrained(model), config, torch.device("cpu"), torch.float32
    )
    rng = np.random.default_rng(1)
    clips = [(0.3 * rng.standard_normal(n)).astype(np.float32) for n in (16037, 80000, 160, 1)]
    clips.append(np.zeros(24000, dtype=np.float32))
    ours, kept = prompts.audio.of(clips)
    out = reference_processor(model)(text="<|AUDIO|>" * len(clips), audio=clips, return_tensors="pt")
    theirs, their_kept = out["input_features"], out["feature_attention_mask"]
    assert kept.sum(-1).tolist() == their_kept.sum(-1).tolist() == [101, 500, 1, 1, 150]
    for i in range(len(clips)):
        assert torch.equal(ours[i][:, kept[i].bool()], theirs[i][:, their_kept[i].bool()]), i


def _pcm16(seconds: float, loudness: Any) -> bytes:
    """A 24 kHz 16-bit clip (a live session's format): a tone in noise whose amplitude is
    `loudness` of the time in seconds."""
    rng = np.random.default_rng(5)
    t = np.arange(int(24000 * seconds)) / 24000
    clip = loudness(t) * (np.sin(2 * np.pi * 330 * t) + 0.15 * rng.standard_normal(t.size))
    return (np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes()


def _spoken(pcm: bytes) -> dict[str, Any]:
    """The clip as a committed turn reaches the thinker: a 16-bit WAV, then a question."""
    wav = io.BytesIO()
    soundfile.write(wav, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
    audio = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"},
    }
    return {"role": "user", "content": [audio, {"type": "text", "text": "And now?"}]}


def windowed_and_whole(
    thinker: Engine, seconds: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Clips of noise this long through the thinker's audio tower whole (`get_audio_features`)
    and window by window (audio_windows.py), and the windows' lengths in frames."""
    from omni_stage.models.qwen_omni.audio_windows import AudioWindows

    prompts, m = thinker.prompts, thinker.model  # type: ignore[attr-defined]
    rng = np.random.default_rng(2)
    clips = [(0.3 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in seconds]
    feats, mask = prompts.audio.of(clips)
    with torch.inference_mode():
        whole = m.get_audio_features(feats, mask).last_hidden_state
    w = AudioWindows(prompts, lambda: m.audio_tower, m.config.audio_config)
    lengths = mask.sum(-1).tolist()
    windows = [
        feats[c, :, i : min(i + w.window, n)] for c, n in enumerate(lengths) for i in range(0, n, w.window)
    ]
    return whole, torch.cat(w.encode(windows)), [x.shape[-1] for x in windows]


def test_the_audio_tower_encodes_window_by_window_what_it_encodes_whole(model: Path) -> None:
    """Qwen2.5-Omni's audio tower attends within windows of `n_window * 2` feature frames (200
    here): two clips (7.3 s and 2.51 s: whole windows, and a partial last one of an odd length)
    encoded window by window, each window alone, give the rows `get_audio_features` gives the
    clips whole, within float32 rounding (1e-5 of the largest value)."""

    async def go() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        (thinker,) = await started(engine("thinker", model))
        return windowed_and_whole(thinker, (7.3, 2.51))

    whole, windowed, sizes = asyncio.run(go())
    assert sizes == [200, 200, 200, 130, 200, 51]
    assert windowed.shape == whole.shape
    torch.testing.assert_close(windowed, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))


async def _speak_ahead(hearing: Engine, key: str, pcm: bytes) -> None:
    """A session's audio reaching the replica that reads its media (the thinker, or an encoder
    stage) as a gateway sends it, 100 ms pieces, at the pace of speech: the encoder keeps up,
    so each window is encoded as soon as it is complete, with what had arrived by then."""
    assert hearing.audio_ahead is not None
    for at in range(0, len(pcm), 4800):
        hearing.audio_ahead.append(key, at // 2, pcm[at : at + 4800], 24000)
        await hearing.audio_ahead.caught_up(key)


@pytest.mark.parametrize(
    ("loudness", "ahead", "encoder_stage"),
    [
        (lambda t: 0.3 + 0 * t, 2, False),
        (lambda t: 10 ** (t - 4.5), 0, False),
        (lambda t: 0.3 + 0 * t, 2, True),
    ],
    ids=["steady", "louder and louder", "steady, encoder stage"],
)
def test_a_sessions_audio_encoded_as_it_arrives_answers_as_the_whole_prefill(
    model: Path, loudness: Any, ahead: int, encoder_stage: bool
) -> None:
    """A 5 s turn (500 feature frames: two whole windows and a partial one) sent ahead in
    100 ms pieces of 24 kHz PCM16, then asked with the session's key: the thinker takes the
    windows encoded as they arrived and encodes only the last, and answers token for token as
    the same request with no key (the whole prefill, which the tests above hold to the
    reference). A voice growing from a whisper to its loudest at the end (by 100 dB) moves the
    features' floor (the loudest frame's, less 80 dB) after each window was encoded: none
    encoded ahead equals the request's, so all are encoded then, and the answer is still the
    same. With an encoder stage, the encoder is what hears ahead. Nothing is left held for the
    session afterwards."""
    pcm = _pcm16(5.0, loudness)

    async def go() -> tuple[dict[str, Any], dict[str, Any], int, int, int]:
        thinker, talker = await started(engine("thinker", model), engine("talker", model))
        encoder = (await started(engine("encoder", model)))[0] if encoder_stage else None
        hearing = encoder or thinker
        a = hearing.audio_ahead
        assert a is not None
        await _speak_ahead(hearing, "s", pcm)
        assert len(a) == 1
        key = {"prompt_cache_key": "s"}
        asked = await run_pipeline(model, "Ethan", 4, [_spoken(pcm)], thinker, encoder, key, talker)
        whole = await run_pipeline(model, "Ethan", 4, [_spoken(pcm)], thinker, encoder, talker=talker)
        return asked, whole, a.windows_ahead, a.windows_late, len(a)

    asked, whole, windows_ahead, windows_late, held = asyncio.run(go())
    assert (windows_ahead, windows_late) == (ahead, 3 - ahead)
    assert held == 0
    assert asked["tokens"].tolist() == whole["tokens"].tolist()
    assert asked["codes"].tolist() == whole["codes"].tolist()


def test_a_turn_sent_faster_than_it_is_encoded_is_taken_encoded_whole(model: Path) -> None:
    """A 5 s turn whose last half arrives while its first window is being encoded (a client that
    appends a recorded turn at once): the request that takes it waits for the window left, and
    takes both whole windows encoded ahead, equal to those of the same turn sent at the pace of
    speech, rather than encoding the second itself (the realtime acceptance counts them). A
    request cancelled while it waits there (aborted) is cancelled, not answered."""

    async def go() -> tuple[dict[bytes, torch.Tensor], dict[bytes, torch.Tensor], int, list[Any]]:
        (thinker,) = await started(engine("thinker", model))
        a = thinker.audio_ahead
        assert a is not None
        pcm = _pcm16(5.0, lambda t: 0.3 + 0 * t)
        await _speak_ahead(thinker, "paced", pcm)
        paced = await a.take("paced")
        half = len(pcm) // 2  # 2.5 s: one window complete
        for at in range(0, half, 4800):
            a.append("at once", at // 2, pcm[at : at + 4800], 24000)
        await asyncio.sleep(0)  # the first window's encoding starts, with the first half...
        for at in range(half, len(pcm), 4800):  # ...and the rest arrives before it ends
            a.append("at once", at // 2, pcm[at : at + 4800], 24000)
        at_once = await a.take("at once")
        for at in range(0, half, 4800):
            a.append("aborted", at // 2, pcm[at : at + 4800], 24000)
        await asyncio.sleep(0)  # its first window encoding...
        taking = asyncio.create_task(a.take("aborted"))
        await asyncio.sleep(0)  # ...and a request waiting for it, cancelled
        taking.cancel()
        return paced, at_once, len(a), await asyncio.gather(taking, return_exceptions=True)

    paced, at_once, held, aborted = asyncio.run(go())
    assert [type(x) for x in aborted] == [asyncio.CancelledError]
    assert len(paced) == 2 and held == 0
    assert at_once.keys() == paced.keys()
    assert all(torch.equal(at_once[k], paced[k]) for k in paced)


def test_audio_ahead_is_bounded_and_freed(model: Path) -> None:
    """Sessions beyond `audioAheadStreams` give up the least recently heard; a piece that does
    not follow the last ends its turn's work ahead, and one that is not 16-bit PCM is dropped;
    a text turn does not take the audio coming; a closed session (forget) and a sleep free what
    they held; a replica with `audioAhead: false` encodes nothing ahead."""

    async def go() -> None:
        (thinker,) = await started(engine("thinker", model, audioAheadStreams=2))
        a = thinker.audio_ahead
        assert a is not None
        pcm = _pcm16(2.5, lambda t: 0.3 + 0 * t)
        for key in ("a", "b", "c"):
            await _speak_ahead(thinker, key, pcm)
        assert len(a) == 2 and await a.take("a") == {}
        assert len(await a.take("b")) == 1
        a.append("c", 0, pcm[:4800], 24000)
        a.append("c", 9999, pcm[4800:9600], 24000)  # a piece was lost: nothing more of it is encoded
        for at in range(9600, len(pcm), 4800):
            a.append("c", at // 2, pcm[at : at + 4800], 24000)
        assert await a.take("c") == {}
        await _speak_ahead(thinker, "d", pcm)
        a.forget("d")
        a.append("z", 0, b"\x01", 24000)  # not 16-bit PCM: dropped
        assert len(a) == 0
        await _speak_ahead(thinker, "e", pcm)
        text = {"request": {"messages": MESSAGES, "media": {}}}
        call = EngineCall("t", text, True, Sampling(max_tokens=1, prompt_cache_key="e"))
        assert [o async for o in thinker.generate(call)]
        assert len(a) == 1  # a text turn of the session leaves the audio coming to its own turn
        await thinker.sleep(1)
        assert len(a) == 0
        (off,) = await started(engine("thinker", model, audioAhead=False))
        assert off.audio_ahead is None

    asyncio.run(go())


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"chunkCodes": 5}, "chunkCodes must be a multiple of 12"),
        ({"chunkCodes": 12, "maxChunkCodes": 30}, "maxChunkCodes must be a multiple of 12"),
        ({"chunkCodes": 24, "maxChunkCodes": 12}, "maxChunkCodes must be at least chunkCodes"),
        ({"chunkCodes": 12, "maxChunkCodes": 48, "busyFirstChunkCodes": 30}, "busyFirstChunkCodes must be a"),
        ({"chunkCodes": 12, "maxChunkCodes": 24, "busyFirstChunkCodes": 48}, r"<= maxChunkCodes \(24\)"),
        ({"chunkCodes": 0, "busyFirstChunkCodes": 24}, "busyFirstChunkCodes sizes a first chunk: set"),
    ],
)
def test_chunks_that_split_a_dit_block_are_refused_at_start(
    model: Path, args: dict[str, int], says: str
) -> None:
    """A chunk's kept left context is whole DiT blocks (24 frames, 12 codes here): a chunk
    that would cut one is refused when the stage starts, naming the argument."""
    with pytest.raises(EngineError, match=says):
        asyncio.run(engine("code2wav", model, **args).start())


def test_the_first_chunk_grows_with_the_load_and_the_audio_does_not(model: Path) -> None:
    """Qwen2.5-Omni's first chunk is already its smallest (a DiT block, 12 codes, with the 12
    after it: docs/models.md). Under load it grows, in whole blocks, up to `busyFirstChunkCodes`
    (`maxChunkCodes`, 48, by default): fewer chunks, each a call and its right context less. Four
    requests fed in the example's windows of 12, one after another, then at once: alone, each
    first chunk is 12 codes; together they grow with the replica's load; every request's audio
    is its whole decode (`chunkCodes: 0`) within 1e-6, whatever its first chunk."""
    edge = load_pipeline(EXAMPLE).spec.stage("code2wav").inputs[0]

    def codes(_: Engine, lengths: tuple[int, ...]) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, CODEC_VOCAB, (n,), generator=gen) for n in lengths]

    async def whole(_: Engine, requests: list[torch.Tensor]) -> list[torch.Tensor]:
        (at_once,) = await started(engine("code2wav", model, chunkCodes=0))
        try:
            calls = [EngineCall("w", {"talker": {"codes": c}}, True, Sampling()) for c in requests]
            return [torch.cat([o.data["audio"] async for o in at_once.generate(c)]) for c in calls]
        finally:
            await at_once.close()

    code2wav = engine("code2wav", model, maxBatch=4)
    lengths = (48, 50, 60, 72)
    check_first_audio_under_load(code2wav, lengths, edge, 0, least=12, codes=codes, whole=whole, atol=1e-6)


@pytest.mark.usefixtures("one_compile_at_a_time")
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
def test_compiled_code2wav_decodes_what_eager_decodes(model: Path, reference: dict[str, Any]) -> None:
    """`compile: true` (torch.compile of the DiT's layers and BigVGAN, here on the CPU's
    inductor backend, which builds its kernels with g++): a first, a middle and a last chunk,
    streamed with kept context, are what the stage decodes without it, within 1e-6 (fused
    kernels may sum in another order); all compiled at start (decode_in_chunks). Chunks of 12
    codes, one request at a time: the warm-up compiles those forms only (three graphs, 50 s of
    CPU alone here, as the suite builds them: tests/conftest.py; every chunk size and batches
    of two take twice that)."""
    codes = reference["codes"][:36]
    forms = {"chunkCodes": 12, "maxChunkCodes": 12, "maxBatch": 1}
    eager, _ = asyncio.run(decode_in_chunks(model, codes, 12, **forms))
    compiled, _ = asyncio.run(decode_in_chunks(model, codes, 12, compile=True, **forms))
    assert [len(c) for c in compiled] == [len(c) for c in eager] and len(eager) == 3
    torch.testing.assert_close(torch.cat(compiled), torch.cat(eager), rtol=0, atol=1e-6)


def test_compile_is_a_switch_or_one_of_torch_compiles_modes(model: Path) -> None:
    """`reduce-overhead` (CUDA graphs on a GPU) and the other modes are taken; anything else is
    refused when the stage is built, naming the argument. The talker takes the modes without
    CUDA graphs only: its KV cache grows at each step, and a graph is recorded per shape."""
    engine("code2wav", model, compile="reduce-overhead")
    with pytest.raises(EngineError, match="compile must be true, false or one of default, reduce-overhead"):
        engine("code2wav", model, compile="fast")
    engine("talker", model, compile="max-autotune-no-cudagraphs")
    refused = r"one of default, max-autotune-no-cudagraphs; got 'reduce-overhead' \(its KV cache grows"
    with pytest.raises(EngineError, match=refused):
        engine("talker", model, compile="reduce-overhead")


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"fixedSteps": True, "maxModelLen": 0}, "maxModelLen must be a whole number above 0"),
        ({"maxModelLen": "long"}, "maxModelLen must be a whole number above 0"),
        ({"maxModelLen": 512.0}, "maxModelLen must be a whole number above 0"),
        ({"cudaGraphs": True}, "cudaGraphs needs device: cuda"),
    ],
)
def test_a_slot_table_out_of_its_bounds_is_refused_when_built(
    model: Path, stage: str, args: dict[str, Any], says: str
) -> None:
    """A thinker's or talker's `maxModelLen` (its context; on a slot table its positions a
    slot) and its graphs are refused when the stage is built, naming the argument, not at a
    request."""
    with pytest.raises(EngineError, match=says):
        engine(stage, model, **args)


@pytest.mark.parametrize("level", [1, 2])
def test_code2wav_asleep_holds_no_weights_and_woken_decodes_the_same(
    model: Path, reference: dict[str, Any], level: int
) -> None:
    """Level 2 frees every weight: none of the DiT's or BigVGAN's tensors outlives the sleep
    (nothing beside the model, such as the layer-by-layer DiT, keeps them); level 1 keeps them
    in host memory, where on the CPU they already are. The woken stage decodes the same audio."""
    codes = reference["codes"][:24]

    async def go() -> tuple[list[torch.Tensor], list[torch.Tensor], bool, dict[str, int]]:
        code2wav = engine("code2wav", model, chunkCodes=12)
        await code2wav.start()

        async def decode() -> list[torch.Tensor]:
            call = EngineCall("r", {"talker": {"codes": codes}}, True, Sampling(voice="Ethan", seed=SEED))
            return [o.data["audio"] async for o in code2wav.generate(call)]

        before = await decode()
        m = code2wav.model  # type: ignore[attr-defined]
        weights = [
            weakref.ref(next(m.code2wav_dit_model.parameters())),
            weakref.ref(next(m.code2wav_bigvgan_model.parameters())),
        ]
        del m
        await code2wav.sleep(level)
        gc.collect()
        freed = all(w() is None for w in weights)
        asleep = code2wav.weight_bytes()
        await code2wav.wake_up(level)
        return before, await decode(), freed, asleep

    before, after, freed, asleep = asyncio.run(go())
    assert freed == (level == 2)
    assert (asleep == {}) == (level == 2)
    assert [a.tolist() for a in after] == [b.tolist() for b in before]
