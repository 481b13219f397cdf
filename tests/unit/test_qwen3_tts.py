"""Qwen3-TTS's talker and speech decoder equal the reference, the `qwen-tts` package's own code
(tests/qwen_tts_reference.py), on the tiny
CustomVoice checkpoint: the reference reads every tensor of it and no other, draws the same codes
greedily (a named speaker, a dialect speaker, a style instruction, both prompt layouts) and its
`generate_custom_voice` and tokenizer `decode` give the same waveforms."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import load_pipeline
from omni_stage.engines.base import EngineCall, EngineError, InvalidRequest
from omni_stage.engines.fixed_steps import FixedSteps
from omni_stage.engines.slot_cache import SlotCache, SlotSteps
from omni_stage.models.qwen3_omni.code_predictor import StaticFrames
from omni_stage.models.qwen3_tts.checkpoint import write_checkpoint
from omni_stage.models.qwen3_tts.loading import load_decoder, load_talker, read_config
from omni_stage.models.qwen3_tts.prompt import TTSIds, tts_prompt
from omni_stage.models.qwen3_tts.steps import TTSSteps
from omni_stage.payload import concat
from tests.helpers import ROOT, asked_while_held, example_stage, ran, wait_until
from tests.qwen_reference import check_first_audio_under_load, cut_while_speaking
from tests.qwen_tts_reference import qwen_tts_reference, waveform

BUDGET = 12
ITEMS = [  # both of the reference's prompt layouts (non-streaming: its default here)
    {"text": "Hello there, how are you?", "speaker": "Vivian", "language": "English", "non_streaming": True},
    {"text": "ni hao", "speaker": "dylan", "language": "Chinese", "non_streaming": False},
    {"text": "A calm voice.", "speaker": "ryan", "language": "Auto", "non_streaming": True},
    {"text": "A calm voice.", "speaker": "ryan", "language": "Auto", "non_streaming": False},
]
ITEMS = [{**item, "instruct": ""} for item in ITEMS] + [
    {
        "text": "A calm voice.",
        "speaker": "ryan",
        "language": "Auto",
        "non_streaming": n,
        "instruct": "Speak slowly.",
    }
    for n in (True, False)
]
DECODE = [[[(7 * f + g) % 2048 for g in range(16)] for f in range(5)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3-tts") / "tiny-qwen3-tts-custom-voice")


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    asked = {"checkpoint": str(checkpoint), "custom_voice": ITEMS, "decode": DECODE, "max_new_tokens": BUDGET}
    return qwen_tts_reference(asked, out), out


def ours(checkpoint: Path, fixed: bool = False) -> tuple[TTSSteps, Any, Any]:
    from transformers import AutoTokenizer

    talker = load_talker(checkpoint, torch.device("cpu"), torch.float32)
    ids = TTSIds.of(read_config(checkpoint))
    frames = StaticFrames(talker, 16, 1, capture=False)
    table = SlotCache.of(talker.config, 1, torch.float32, torch.device("cpu"))
    steps = SlotSteps(table, talker.model)
    if fixed:  # the steps at fixed shapes, as `cudaGraphs` captures them on CUDA
        steps = FixedSteps(table, talker.model, 1, talker.config.hidden_size, 0, capture=False)
    return TTSSteps(talker, ids, frames, steps), AutoTokenizer.from_pretrained(checkpoint), ids


def turn(tok: Any, text: str, role: str = "assistant", reply: bool = True) -> torch.Tensor:
    tail = "<|im_start|>assistant\n" if reply else ""
    return tok(f"<|im_start|>{role}\n{text}<|im_end|>\n{tail}", return_tensors="pt").input_ids


def test_the_reference_reads_every_tensor_of_the_checkpoint(reference: tuple[dict[str, Any], Path]) -> None:
    result, _ = reference
    assert result["model"] == {"unexpected": [], "missing": []}
    assert result["speech_tokenizer"] == {"unexpected": [], "missing": []}


@torch.inference_mode()
@pytest.mark.parametrize("fixed", [False, True], ids=["steps", "fixed-steps"])
def test_custom_voice_codes_and_audio_equal_the_reference(
    checkpoint: Path, reference: tuple[dict[str, Any], Path], fixed: bool
) -> None:
    result, out = reference
    speaker, tok, ids = ours(checkpoint, fixed)
    decoder = load_decoder(checkpoint, torch.device("cpu"))
    spoken = []
    for i, item in enumerate(ITEMS):
        instruct = turn(tok, item["instruct"], "user", reply=False) if item["instruct"] else None
        prompt = tts_prompt(
            speaker.talker,
            ids,
            turn(tok, item["text"]),
            item["language"],
            item["speaker"],
            instruct,
            item["non_streaming"],
        )
        codes = speaker.speak(prompt, BUDGET)
        assert codes == result["custom_voice"][i], item
        wav = decoder(torch.tensor(codes).T[None])[0, 0]
        np.testing.assert_allclose(wav.numpy(), waveform(out, f"custom_voice_{i}"), atol=1e-6, rtol=0)
        spoken.append(codes)
    # Not vacuous: each voice, text, layout and instruction speaks codes of its own.
    assert len({json.dumps(c) for c in spoken}) == len(ITEMS)


@torch.inference_mode()
def test_the_decoder_equals_the_tokenizers_decode(
    checkpoint: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    _, out = reference
    decoder = load_decoder(checkpoint, torch.device("cpu"))
    wav = decoder(torch.tensor(DECODE[0]).T[None])[0, 0]
    expected = waveform(out, "decode_0")
    assert wav.shape[0] == len(DECODE[0]) * 1920 == expected.shape[0]
    np.testing.assert_allclose(wav.numpy(), expected, atol=1e-6, rtol=0)
    assert float(np.abs(expected).max()) > 1e-3  # a waveform, not silence


@torch.inference_mode()
def test_the_decoder_streamed_piece_by_piece_is_the_whole_decode(checkpoint: Path) -> None:
    """Each code decoded once, from what the codes before it left (streaming.py): pieces of
    any length, two requests batched at different places (one still filling its attention
    window, one past it), 400 codes (past the tiny decoder's reach, 144, and the reference's
    300-code chunks): every sample the whole decode's, within float rounding."""
    decoder = load_decoder(checkpoint, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2048, (2, 16, 400), generator=gen)
    whole = decoder(codes)[:, 0]
    first, second = decoder.streams.start(), decoder.streams.start()
    out: list[list[torch.Tensor]] = [[], []]
    out[0].append(decoder.streams.decode(codes[:1, :, :1], [first])[0, 0])
    out[1].append(decoder.streams.decode(codes[1:, :, :30], [second])[0, 0])
    for n in (24, 25, 50):  # both together, 29 codes apart
        at, other = first.seen, second.seen
        pair = torch.stack([codes[0, :, at : at + n], codes[1, :, other : other + n]])
        wav = decoder.streams.decode(pair, [first, second])
        out[0].append(wav[0, 0])
        out[1].append(wav[1, 0])
    for row, stream in enumerate((first, second)):
        rest = codes[row : row + 1, :, stream.seen :]
        out[row].append(decoder.streams.decode(rest, [stream])[0, 0])
        assert stream.seen == 400  # each code through the stream once
        torch.testing.assert_close(torch.cat(out[row]), whole[row], rtol=0, atol=1e-6)
    assert all(layer.keys.shape[-2] == 71 for layer in first.past.layers)  # the window's, no more


def test_a_streamed_decoder_takes_no_left_context(checkpoint: Path) -> None:
    with pytest.raises(EngineError, match="leftContextCodes: Qwen3-TTS's decoder streams"):
        example_stage(EXAMPLE, "code2wav", checkpoint, leftContextCodes=25)


def test_an_unknown_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Qwen3-TTS variant 'klingon'"):
        write_checkpoint(tmp_path, "klingon")


EXAMPLE = ROOT / "examples" / "qwen3-tts.yaml"
DESIGNS = [  # a voice described, in both layouts
    {"text": "The sea is calm.", "language": "English", "instruct": "A deep, slow voice.", "non_streaming": n}
    for n in (True, False)
]


def test_a_cut_request_gives_its_slot_back(checkpoint: Path) -> None:
    """A request cut while the talker speaks (its task cancelled: a client gone) holds its slot
    of the replica's cache until the stage's runner says it ended (`request_ended`, called here
    as the runner calls it), once the step in progress is over; a request spoken to its end
    gives its slot back by itself."""

    async def go() -> None:
        talker = example_stage(EXAMPLE, "talker", checkpoint)
        await talker.start()
        sampling = Sampling(max_tokens=BUDGET)
        done = EngineCall("d", {"request": {"prompt": "The sea is calm."}}, True, sampling)
        assert [o async for o in talker.generate(done)] and talker.active_requests() == 0
        await cut_while_speaking(
            talker, EngineCall("c", {"request": {"prompt": "The sea is calm."}}, True, sampling)
        )
        await talker.close()

    asyncio.run(go())


async def speak(talker: Any, text: str, name: str) -> tuple[list[list[int]], str | None]:
    """`text` spoken by a talker stage alone: its frames and its finish reason; the request's
    end said as the stage's runner says it, however it ends."""
    call = EngineCall(name, {"request": {"prompt": text}}, True, Sampling(max_tokens=BUDGET))
    try:
        frames = [o.data["codes"][0].tolist() async for o in talker.generate(call)]
    finally:
        talker.request_ended(call.state)
    return frames, call.state.finish_reason


def test_a_talker_bounded_by_max_model_len_speaks_the_first_frames_and_allocates_nothing_more(
    checkpoint: Path,
) -> None:
    """A talker at fixed shapes with `maxModelLen` (its slot table allocated once, at load, at
    that many positions a slot: nothing allocated nor, on CUDA, captured while it serves): a
    prompt past it is refused with a 400 that names it, its slot given back; two requests of
    prompts of different lengths, at once, each speak the first frames the same talker
    unbounded speaks, as many as the positions left after their prompts, and end there
    ("length"); the table never grew and no slot is held after."""
    texts = ("The sea is calm.", "The sea is calm tonight.")
    refusal = r"the prompt takes (\d+) positions here, past this stage's maxModelLen of 1"

    async def go() -> None:
        talker = example_stage(EXAMPLE, "talker", checkpoint, fixedSteps=True, maxModelLen=1)
        await talker.start()
        prompts = []
        for i, text in enumerate(texts):
            with pytest.raises(InvalidRequest, match=refusal) as refused:
                await speak(talker, text, f"p{i}")
            said = re.match(refusal, str(refused.value))
            assert said is not None
            prompts.append(int(said.group(1)))
        await talker.close()
        assert prompts[0] < prompts[1]
        unbounded = example_stage(EXAMPLE, "talker", checkpoint)
        await unbounded.start()
        whole = [(await speak(unbounded, text, f"u{i}"))[0] for i, text in enumerate(texts)]
        await unbounded.close()
        bound = prompts[1] + 3
        talker = example_stage(EXAMPLE, "talker", checkpoint, fixedSteps=True, maxModelLen=bound)
        await talker.start()
        assert talker.active_requests() == 0
        spoken = await asyncio.gather(*(speak(talker, text, f"b{i}") for i, text in enumerate(texts)))
        for (frames, reason), full, prompt in zip(spoken, whole, prompts, strict=True):
            assert bound - prompt < len(full)  # not vacuous: the unbounded talker speaks on
            assert frames == full[: bound - prompt] and reason == "length"
        assert talker.slots is not None and talker.slots.grown == 0 and talker.active_requests() == 0
        await talker.close()

    asyncio.run(go())


async def held_at_once(talker: Any, texts: tuple[str, ...]) -> tuple[list[Any], list[int], list[int]]:
    """`texts` asked of `talker` at once while its compute thread is held (asked_while_held;
    the prompts are built there, with the model's embeddings): what each request gave (its
    frames and finish reason, or its error), the sizes of the prefill batches that ran, and of
    those that ran whole (not failed)."""
    prefills = talker.prefills
    before, sizes = Counter(prefills.calls), Counter(prefills.batch_sizes)
    asks = [speak(talker, t, f"h{i}") for i, t in enumerate(texts)]
    spoken = await asked_while_held(talker, prefills, asks, built_on_compute=True)
    return spoken, sorted((prefills.batch_sizes - sizes).elements()), ran(prefills, before)


def test_prompts_queued_together_are_prefilled_together_as_each_alone(checkpoint: Path) -> None:
    """With `prefillBatchTokens` (on CUDA by default), the prompts that queue behind a prefill
    go in one forward, each request speaking the frames it speaks alone. Refused there (past
    `maxModelLen`), the batch runs again a prompt at a time, each refused with its own length,
    and no slot is left held."""
    texts = ("Calm.", "The sea is calm.", "The sea is calm tonight, and the wind is low.")
    refusal = r"the prompt takes (\d+) positions here, past this stage's maxModelLen of 1"

    async def go() -> None:
        talker = example_stage(EXAMPLE, "talker", checkpoint, prefillBatchTokens=2048)
        await talker.start()
        alone = [await speak(talker, t, f"a{i}") for i, t in enumerate(texts)]
        together, batches, whole = await held_at_once(talker, texts)
        assert batches == whole == [1, 2] and together == alone
        assert all(len(frames) > 4 for frames, _ in alone)
        assert talker.active_requests() == 0
        await talker.close()
        bounded = example_stage(EXAMPLE, "talker", checkpoint, prefillBatchTokens=2048, maxModelLen=1)
        await bounded.start()
        refused, batches, whole = await held_at_once(bounded, texts)
        assert batches == [1, 2] and whole == []  # (the batch of two refused, then each alone)
        lengths = []
        for r in refused:
            said = re.match(refusal, str(r))
            assert isinstance(r, InvalidRequest) and said is not None, r
            lengths.append(int(said.group(1)))
        assert lengths == sorted(set(lengths))  # each its own prompt's
        # (given back once the compute thread has ended the work in progress: request_ended)
        await wait_until(lambda: bounded.active_requests() == 0, 30, "every slot given back")
        await bounded.close()

    asyncio.run(go())


def test_a_request_stepping_above_the_batch_size_steps_at_fixed_shapes(checkpoint: Path) -> None:
    """With `maxBatch: 1` (its requests step one at a time) and the example's `maxInflight` 8,
    a talker at fixed shapes has a slot for each request in flight, and a request stepping
    alone at its slot above the first steps in a bucket of the table's first rows: no step
    takes the table's own shapes (on CUDA: every step a replay, none launched eagerly), and
    two requests at once speak what each speaks alone."""
    texts = ("The sea is calm.", "A calm voice.")

    async def go() -> None:
        talker = example_stage(EXAMPLE, "talker", checkpoint, fixedSteps=True, maxModelLen=256, maxBatch=1)
        await talker.start()
        assert talker.slots is not None and talker.slots.capacity[0] == 8
        alone = [(await speak(talker, text, f"a{i}"))[0] for i, text in enumerate(texts)]
        together = [
            f for f, _ in await asyncio.gather(*(speak(talker, t, f"t{i}") for i, t in enumerate(texts)))
        ]
        assert together == alone and all(len(frames) > 4 for frames in alone)
        ran = talker.slot_steps()
        assert ran is not None and ran["own"] == 0 and ran["fixed"] > 0
        await talker.close()

    asyncio.run(go())


@pytest.mark.parametrize("stage", ["talker", "code2wav"])
def test_each_stage_computes_on_the_threads_it_is_given(checkpoint: Path, stage: str) -> None:
    """`threads` (the example's 1) is honoured on the stage's compute thread, where its model
    runs: ignored, both stages ran on every core, against each other (the c8 benchmark at 0.39
    of the reference's batch)."""

    async def threads() -> int:
        engine = example_stage(EXAMPLE, stage, checkpoint, threads=1)
        await engine._run(torch.set_num_threads, 2)  # as a process on two cores starts
        await engine.start()
        try:
            return await engine._run(torch.get_num_threads)
        finally:
            await engine.close()

    assert asyncio.run(threads()) == 1


def test_first_audio_after_one_code_alone_and_under_load_is_the_whole_decode(checkpoint: Path) -> None:
    """The speech tokenizer's decoder is causal and leaves nothing to the next code: one code's
    1920 samples are final, the first audio (`firstChunkCodes: 1`); then pieces of 25
    codes, streamed. Four requests at once: each first piece sized by the replica's load when its
    codes came (one code idle, up to 25 busy), batched; every request's audio the whole
    decode's within 1e-5, whatever its first piece."""
    edge = load_pipeline(EXAMPLE).spec.stage("code2wav").inputs[0]
    check_first_audio_under_load(
        example_stage(EXAMPLE, "code2wav", checkpoint, maxBatch=4), (40, 45, 52, 60), edge, 0
    )


@pytest.fixture(scope="module")
def designed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """A tiny VoiceDesign checkpoint, and the reference's `generate_voice_design` on it."""
    ckpt = write_checkpoint(
        tmp_path_factory.mktemp("qwen3-tts") / "tiny-qwen3-tts-voice-design", "voice_design"
    )
    out = tmp_path_factory.mktemp("qwen-tts-reference")
    asked = {"checkpoint": str(ckpt), "voice_design": DESIGNS, "max_new_tokens": BUDGET}
    return ckpt, qwen_tts_reference(asked, out), out


async def through_the_stages(
    ckpt: Path, prompt: str, sampling: Sampling
) -> tuple[list[list[int]], np.ndarray]:
    """The example's two stages on `ckpt`, in this process: the talker's frames, code2wav's audio."""
    talker, code2wav = example_stage(EXAMPLE, "talker", ckpt), example_stage(EXAMPLE, "code2wav", ckpt)
    for e in (talker, code2wav):
        await e.start()
    try:
        frames = [
            o.data
            async for o in talker.generate(EngineCall("r", {"request": {"prompt": prompt}}, True, sampling))
        ]
        call = EngineCall("r", {"talker": concat(frames)}, True, Sampling())
        audio = [o.data["audio"] async for o in code2wav.generate(call)]
    finally:
        for e in (talker, code2wav):
            await e.close()
    return concat(frames)["codes"].tolist(), torch.cat(audio).numpy()


def test_a_designed_voice_equals_the_reference(designed: tuple[Path, dict[str, Any], Path]) -> None:
    """VoiceDesign through the stage engines (the non-streaming layout, the served one) and
    through the steps (both layouts): the voice is the one the instruction describes."""
    ckpt, result, out = designed
    first = DESIGNS[0]
    sampling = Sampling(max_tokens=BUDGET, instructions=first["instruct"], language=first["language"])
    codes, audio = asyncio.run(through_the_stages(ckpt, first["text"], sampling))
    assert codes == result["voice_design"][0]
    np.testing.assert_allclose(audio, waveform(out, "voice_design_0"), atol=1e-6, rtol=0)
    steps, tok, ids = ours(ckpt)
    assert ids.speakers == {}
    for i, item in enumerate(DESIGNS):
        instruct = turn(tok, item["instruct"], "user", reply=False)
        prompt = tts_prompt(
            steps.talker,
            ids,
            turn(tok, item["text"]),
            item["language"],
            None,
            instruct,
            item["non_streaming"],
        )
        assert steps.speak(prompt, BUDGET) == result["voice_design"][i], item


def test_a_voice_design_model_takes_no_voice_and_needs_a_description(
    designed: tuple[Path, dict[str, Any], Path],
) -> None:
    ckpt, _, _ = designed
    talker = example_stage(EXAMPLE, "talker", ckpt)
    asyncio.run(talker.start())
    assert talker.voices == ()
    with pytest.raises(
        InvalidRequest, match="instructions: a VoiceDesign model speaks in the voice they describe"
    ):
        asyncio.run(through_the_stages(ckpt, "Hi", Sampling(max_tokens=4)))
