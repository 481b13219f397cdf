"""The reference every Qwen2.5-Omni test compares with: transformers' own
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`, greedy, as its
documentation runs it."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import inspect
import io
import json
import os
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.hooks import RemovableHandle

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import InputSpec
from omni_stage.engines.base import CallState, Engine, EngineCall, InvalidRequest
from omni_stage.payload import Payload, concat
from omni_stage.segments import EngineOutput
from omni_stage.windows import WindowState
from tests.helpers import asked_while_held, logits_positions, ran, video_file, wait_until


def reference_processor(path: Path) -> Any:
    """transformers' `Qwen2_5OmniProcessor`, as its documentation loads it."""
    from transformers import Qwen2_5OmniProcessor

    return Qwen2_5OmniProcessor.from_pretrained(path)


def kept_beside_the_checkpoint(generate: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`generate` once per checkpoint and inputs: the same call again (another module, another
    worker of the run) reads the same tensors from what the first wrote beside the checkpoint,
    named by a digest of the inputs (arrays and images by their bytes) and of the checkpoint's
    weights file (its size and time: a checkpoint written again is another). A reference costs
    about 16 s of CPU, and the suite asks for each several times."""
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def kept(*args: Any, **kwargs: Any) -> dict[str, Any]:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        path: Path = call.arguments["path"]
        weights = (path / "model.safetensors").stat()
        digest = hashlib.sha256(f"{weights.st_size} {weights.st_mtime_ns}".encode())
        _digest(digest, [v for k, v in call.arguments.items() if k != "path"])
        file = path.parent / ".references" / f"{path.name}-{digest.hexdigest()[:32]}.safetensors"
        if file.exists():
            with safe_open(str(file), "pt") as f:
                return {"text": f.metadata()["text"]} | {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        ref = generate(*args, **kwargs)
        file.parent.mkdir(exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in ref.items() if k != "text"}, str(tmp), {"text": ref["text"]})
        os.replace(tmp, file)  # whole or not at all, whichever of the run's workers writes it
        return ref

    return kept


def _digest(digest: Any, value: Any) -> None:
    if isinstance(value, np.ndarray):
        digest.update(f"{value.dtype} {value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Image.Image):
        digest.update(f"{value.mode} {value.size}".encode() + value.tobytes())
    elif isinstance(value, list | tuple):
        digest.update(b"[")
        for v in value:
            _digest(digest, v)
        digest.update(b"]")
    else:
        digest.update(json.dumps(value, sort_keys=True).encode())


@kept_beside_the_checkpoint
def reference_generate(
    path: Path,
    messages: list[dict[str, Any]],
    thinker_tokens: int,
    talker_codes: int,
    seed: int,
    voice: str,
    audio: list[np.ndarray] | None = None,
    images: list[Image.Image] | None = None,
    videos: list[np.ndarray] | None = None,
    fps: float | None = None,
    processor_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reply's token ids and text, the talker's codes (as its token2wav receives them) and
    the waveform. `torch.manual_seed(seed)` goes right before generate: greedy decoding draws
    nothing, so the DiT's starting noise is the first random draw after it. `audio` (16 kHz),
    `images` and `videos` (frames [T, H, W, 3], taken at `fps`) fill the messages' audio,
    image and video parts, in order, through the model's processor, as its documentation
    runs it; `processor_kwargs` go to that processor call (as vLLM passes mm_processor_kwargs).
    Generated once per run (kept_beside_the_checkpoint)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    proc = reference_processor(path)
    tok = proc.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = proc(
        text=text,
        audio=audio,
        images=images,
        videos=videos,
        fps=fps,
        return_tensors="pt",
        **(processor_kwargs or {}),
    )
    # Images and videos go to the thinker alone (the `thinker_` prefix generate documents):
    # unprefixed, generate hands `pixel_values` to the talker's generate too, which refuses it
    # (5.19). The talker reads neither: without an attention mask its positions ignore the grid.
    media = {
        f"thinker_{k}" if k.startswith(("pixel_values", "image_grid", "video_")) else k: v
        for k, v in ids.items()
        if k not in ("input_ids", "attention_mask")
    }
    seen: dict[str, torch.Tensor] = {}

    def keep_codes(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen["codes"] = args[0][0].clone()

    ref.token2wav.register_forward_pre_hook(keep_codes)
    talker = ref.config.talker_config
    torch.manual_seed(seed)
    seq, wav = ref.generate(
        ids["input_ids"],
        **media,
        speaker=voice,
        thinker_max_new_tokens=thinker_tokens,
        talker_max_new_tokens=talker_codes,
        talker_do_sample=False,
        talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
        return_audio=True,
    )
    reply = seq[0, ids["input_ids"].shape[1] :]
    return {
        "tokens": reply,
        "text": tok.decode(reply, skip_special_tokens=True),
        "codes": seen["codes"],
        "audio": wav,
    }


def media_clips() -> tuple[bytes, bytes]:
    """A 1.5 s 16 kHz clip (a tone in noise, float WAV: lossless) and a 90x60 PNG, from a seed."""
    rng = np.random.default_rng(3)
    t = np.arange(24000) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    wav = io.BytesIO()
    soundfile.write(wav, clip, 16000, format="WAV", subtype="FLOAT")
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(png, format="PNG")
    return wav.getvalue(), png.getvalue()


MEDIA_QUESTION = "What do you hear and see?"


def media_message(wav: bytes, png: bytes) -> dict[str, Any]:
    """Text, audio and an image, as the openai client sends them."""
    return {
        "role": "user",
        "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
            {
                "type": "image_url",
                "image_url": {"url": f"data:image/png;base64,{base64.b64encode(png).decode()}"},
            },
            {"type": "text", "text": MEDIA_QUESTION},
        ],
    }


def reference_with_media(
    path: Path,
    thinker_tokens: int,
    talker_codes: int,
    seed: int,
    voice: str,
    processor_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference on `media_message`'s question, clip and image, as a transformers user
    passes them: the clip read with soundfile, the image opened with Pillow."""
    wav, png = media_clips()
    clip, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == 16000
    parts = [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": MEDIA_QUESTION}]
    image = Image.open(io.BytesIO(png))
    return reference_generate(
        path,
        [{"role": "user", "content": parts}],
        thinker_tokens,
        talker_codes,
        seed,
        voice,
        [clip],
        [image],
        processor_kwargs=processor_kwargs,
    )


VIDEO_FPS = 4
VIDEO_QUESTION = "What happens in this video?"


def video_clip() -> tuple[bytes, np.ndarray]:
    """A 2 s video at 4 frames a second (56x84, random frames from a seed), losslessly coded,
    and its frames."""
    frames = np.random.default_rng(5).integers(0, 256, (2 * VIDEO_FPS, 56, 84, 3), dtype=np.uint8)
    return video_file(frames, VIDEO_FPS), frames


def video_message(mkv: bytes) -> dict[str, Any]:
    """Text and a video, as vLLM's clients send it (`video_url`, a data: URL)."""
    url = f"data:video/x-matroska;base64,{base64.b64encode(mkv).decode()}"
    return {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": VIDEO_QUESTION},
        ],
    }


def reference_with_video(
    path: Path, thinker_tokens: int, talker_codes: int, seed: int, voice: str
) -> dict[str, Any]:
    """The reference on `video_message`'s question and video, taken at 2 frames a second as
    Qwen's own video loader takes them (every other frame of this 4 fps clip)."""
    _, frames = video_clip()
    parts = [{"type": "video"}, {"type": "text", "text": VIDEO_QUESTION}]
    return reference_generate(
        path,
        [{"role": "user", "content": parts}],
        thinker_tokens,
        talker_codes,
        seed,
        voice,
        videos=[frames[::2]],
        fps=2.0,
    )


def reference_qwen3(
    path: Path,
    parts: list[dict[str, Any]],
    thinker_tokens: int,
    talker_codes: int,
    voice: str,
    audio: list[np.ndarray] | None = None,
    images: list[Image.Image] | None = None,
    videos: list[np.ndarray] | None = None,
    fps: float | None = None,
) -> dict[str, Any]:
    """Qwen3-Omni's reference: `Qwen3OmniMoeForConditionalGeneration.generate(...,
    return_audio=True)` with greedy decoding throughout (`talker_do_sample=False`, which its
    code predictor follows), on one user message of `parts`, the media through
    `Qwen3OmniMoeProcessor` as its documentation runs it. The reply's ids and text, the codes
    as Code2Wav receives them ([n, codebooks]) and the waveform.

    One correction, of a transformers 5.19 bug: the talker's M-RoPE positions read the audio
    encoder's window from `talker.config.audio_config`, which its config lacks, so generate
    fails on any audio input; the thinker's audio config is the one meant (the stage does the
    same)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()
    ref.talker.config.audio_config = ref.thinker.config.audio_config
    proc = Qwen3OmniMoeProcessor.from_pretrained(path)
    text = proc.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    inputs = proc(text=text, audio=audio, images=images, videos=videos, fps=fps, return_tensors="pt")
    seen: dict[str, torch.Tensor] = {}

    def keep_codes(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.setdefault("codes", args[0][0].T.clone())

    ref.code2wav.register_forward_pre_hook(keep_codes)
    seq, wav = ref.generate(
        **inputs,
        speaker=voice,
        thinker_max_new_tokens=thinker_tokens,
        thinker_eos_token_id=ref.generation_config.eos_token_id,
        thinker_do_sample=False,
        talker_max_new_tokens=talker_codes,
        talker_do_sample=False,
    )
    reply = seq[0, inputs["input_ids"].shape[1] :]
    return {
        "tokens": reply,
        "text": proc.tokenizer.decode(reply, skip_special_tokens=True),
        "codes": seen["codes"],
        "audio": wav.reshape(-1),
    }


def windows(outputs: list[EngineOutput], n: int, first: int | None = None) -> list[tuple[Payload, bool]]:
    """A producer's outputs as its consumer receives them on a window of `n` (the first chunk
    `first` units, where given): the stage's own windows cut them."""
    data = concat([o.data for o in outputs if o.data])
    chunks = WindowState(n, first).push(data, sum(o.units for o in outputs), True)
    return [(c.payload, c.is_last) for c in chunks]


async def vocode(code2wav: Engine, codes: torch.Tensor, edge: InputSpec) -> list[torch.Tensor]:
    """`codes` [n, groups] through a code2wav stage as `edge` (its in-edge) feeds them: the
    audio chunks it sends."""
    state, chunks = CallState(), []
    talked = [EngineOutput(len(codes), data={"codes": codes})]
    for payload, last in windows(talked, edge.window, edge.first_window):
        call = EngineCall("r", {"talker": payload}, last, Sampling(), state)
        chunks += [o.data["audio"] async for o in code2wav.generate(call)]
    return chunks


Vocoded = list[list[torch.Tensor]]


def random_codes(code2wav: Engine, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Random codes [n, groups] of these lengths for a Qwen3 code2wav stage (started)."""
    m = code2wav.model  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    groups, book = m.config.num_quantizers, m.config.codebook_size
    return [torch.randint(0, book, (n, groups), generator=gen) for n in lengths]


async def whole_decodes(code2wav: Engine, requests: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each request's codes decoded at once by a Qwen3 code2wav stage's decoder (what the
    reference decodes)."""
    with torch.inference_mode():
        return [code2wav.model(codes.T[None])[0, 0] for codes in requests]  # type: ignore[attr-defined]


def check_first_audio_under_load(
    code2wav: Engine,
    lengths: tuple[int, ...],
    edge: InputSpec,
    short: int,
    least: int = 1,
    codes: Callable[[Engine, tuple[int, ...]], list[torch.Tensor]] = random_codes,
    whole: Callable[[Engine, list[torch.Tensor]], Awaitable[list[torch.Tensor]]] = whole_decodes,
    atol: float = 1e-5,
) -> None:
    """Codes of these lengths (`codes`) through a code2wav stage fed as `edge` feeds them, one
    request after another and then all at once (its `maxBatch` at least as many): alone, each
    first piece is `least` codes (the samples a decode of them has final: all but the `short`
    they leave to the next code); together, each first piece is sized by the replica's load
    when its codes came, growing from `least`; pieces batch; and each request's audio is the
    whole decode of its codes (`whole`) within `atol`, whatever its first piece: the load
    changes when audio comes, not what."""

    async def go() -> tuple[list[torch.Tensor], Vocoded, Vocoded]:
        await code2wav.start()
        try:
            requests = codes(code2wav, lengths)
            wholes = await whole(code2wav, requests)
            alone = [await vocode(code2wav, c, edge) for c in requests]
            together = await asyncio.gather(*(vocode(code2wav, c, edge) for c in requests))
        finally:
            await code2wav.close()
        return wholes, alone, list(together)

    wholes, alone, together = asyncio.run(go())
    per_code = int(code2wav.upsample)  # type: ignore[attr-defined]
    assert max(code2wav.batcher.batch_sizes) >= 2  # type: ignore[attr-defined]
    assert [len(chunks[0]) for chunks in alone] == [least * per_code - short] * len(lengths)
    firsts = [(len(chunks[0]) + short) // per_code for chunks in together]  # the first pieces' codes
    assert firsts[0] == least and firsts == sorted(firsts) and firsts[-1] > least, firsts
    for ref, *streams in zip(wholes, alone, together, strict=True):
        for chunks in streams:
            assert torch.cat(chunks).shape == ref.shape
            torch.testing.assert_close(torch.cat(chunks), ref, rtol=0, atol=atol)


async def cut_while_speaking(talker: Engine, call: EngineCall) -> None:
    """`call` on `talker` cut after its first output, while it speaks (its task cancelled: a
    client gone, a barge-in); the slot it held is given back once the stage's runner says the
    request ended (`request_ended`, called here as the runner calls it) and the step in
    progress is over: the replica's gauge of what it holds (`active_requests`) says so."""
    first = asyncio.Event()

    async def speak() -> None:
        async for _ in talker.generate(call):
            first.set()

    task = asyncio.create_task(speak())
    await asyncio.wait_for(first.wait(), 30)
    assert talker.active_requests() == 1
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()  # cut while it spoke
    talker.request_ended(call.state)
    await wait_until(lambda: talker.active_requests() == 0, 30, "the cut request's slot back")


def slot_table(talker: Engine) -> tuple[int, int, int]:
    """A talker's slot table (engines/slot_cache.py): the request caches copied so far (one at
    each prefill, into its slot), the slots held, and the address of its first layer's keys
    (the same while the table is not reallocated)."""
    table = talker.slots  # type: ignore[attr-defined]
    return table.copies, table.taken, table.layers[0].keys.data_ptr()


def counts_uncompiled(decoder: torch.nn.Module, shapes: list[tuple[int, ...]]) -> RemovableHandle:
    """The forwards of `decoder` (a talker's decoder layers, compiled or not) run uncompiled,
    each its input's shape added to `shapes`: a hook on its first layer, which Dynamo traces
    into a compiled graph, where `is_compiling()` holds, adds nothing there."""
    layer = getattr(decoder, "_orig_mod", decoder).layers[0]

    def hook(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.compiler.is_compiling():
            shapes.append(tuple((args[0] if args else kwargs["hidden_states"]).shape))

    return layer.register_forward_pre_hook(hook, with_kwargs=True)


def check_a_bounded_talker(pipeline: Callable[[int], dict[str, Any]], reference: dict[str, Any]) -> None:
    """`pipeline(bound)`: a pipeline's outputs with its talker at fixed shapes and `maxModelLen`
    `bound` (its slot table allocated at load at that many positions a slot, never grown). A
    bound of 1 is refused with a 400 that names it and the talker's prompt; a bound five
    positions past the prompt speaks the reference's first five codes and ends there."""
    with pytest.raises(InvalidRequest, match="past this stage's maxModelLen of 1") as refused:
        pipeline(1)
    said = re.search(r"the prompt takes (\d+) positions here", str(refused.value))
    assert said is not None
    ours = pipeline(int(said.group(1)) + 5)
    assert ours["tokens"].tolist() == reference["tokens"].tolist()
    assert len(reference["codes"]) > 5  # not vacuous: the reference speaks on
    assert ours["codes"].tolist() == reference["codes"][:5].tolist()


PREFILL_QUESTIONS = ["Tell me about the sea.", "What is the weather like on the moon?", "Hi."]
"""Three prompts of text, of three lengths."""


def check_prompts_prefilled_together(
    thinker: Engine, questions: list[str], tokens: int, batched: bool = True, refused: int | None = None
) -> None:
    """`questions` (three prompts of text) asked of `thinker` (started here, closed after) at
    once while its compute thread is held (their prompts are built beside it, on the prompt
    thread): the first prefill to queue runs alone, and
    (`batched`: `prefillBatchTokens` holding two) the two queued behind it together
    (kv_batch.prefill_together), else each alone; each request's tokens, and what the talker
    reads of its prompt, are those it gets alone; no forward's logits are computed at more than
    one position a request (last_logits.py: a prompt's next token reads its last). `refused`:
    that question asked with constraints that leave no first token (only the end allowed, and
    `min_tokens` banning it), refused together as alone; the batch it fails runs again a
    prompt at a time, the others thinking what they think alone."""
    assert len(questions) == 3

    async def think(i: int) -> dict[str, Any]:
        request = {"messages": [{"role": "user", "content": questions[i]}]}
        sampling = Sampling(max_tokens=tokens)
        if i == refused:
            eos = min(thinker.eos)  # type: ignore[attr-defined]
            sampling = Sampling(max_tokens=tokens, min_tokens=2, allowed_token_ids=[eos])
        call = EngineCall(questions[i], {"request": request}, True, sampling)
        return concat([o.data async for o in thinker.generate(call)])

    async def go() -> tuple[list[Any], list[Any], list[int]]:
        await thinker.start()
        with logits_positions(thinker.model.get_output_embeddings()) as positions:  # type: ignore[attr-defined]
            alone = [await asyncio.gather(think(i), return_exceptions=True) for i in range(3)]
            alone = [a for [a] in alone]
            batcher = thinker.batcher  # type: ignore[attr-defined]
            before = Counter(batcher.calls)
            together = await asked_while_held(thinker, batcher, [think(i) for i in range(3)])
        await thinker.close()
        prefills = [
            size for (key, size), n in (batcher.calls - before).items() if key != "decode" for _ in range(n)
        ]
        assert positions and set(positions) == {1}, positions
        return alone, together, sorted(prefills)

    alone, together, prefills = asyncio.run(go())
    if refused is None:
        assert prefills == ([1, 2] if batched else [1, 1, 1]), prefills
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        if i == refused:
            for refusal in (a, b):
                assert isinstance(refusal, InvalidRequest), refusal
                assert "leave no token that may come next" in str(refusal)
            continue
        assert not isinstance(b, BaseException), b
        assert a["token_ids"].tolist() == b["token_ids"].tolist()
        for name in ("prompt_embeds", "prompt_hidden"):
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-4)


def check_talker_prompts_prefilled_together(
    thinker: Engine, talker: Engine, questions: list[str], codes: int, voice: str | None = None
) -> None:
    """`questions` (three prompts of text) thought by `thinker`, then spoken by `talker` (its
    `prefillBatchTokens` holding two prompts; both started here, closed after) at once while
    its compute thread is held: the first prefill to queue runs alone, the two queued behind
    it in one forward (SlotSteps.prefill_together), and each request speaks the codes it
    speaks alone, no forward's logits computed at more than one position a request. Each
    prompt's cache is copied once, into its slot, and every slot is given back."""
    assert len(questions) == 3

    async def go() -> tuple[list[Any], list[Any], list[int]]:
        await thinker.start()
        await talker.start()
        thoughts = []
        for q in questions:
            request = {"messages": [{"role": "user", "content": q}]}
            call = EngineCall(q, {"request": request}, True, Sampling(max_tokens=8))
            thoughts.append(concat([o.data async for o in thinker.generate(call)]))

        async def talk(thought: Payload) -> list[Any]:
            call = EngineCall("r", {"thinker": thought}, True, Sampling(max_tokens=codes, voice=voice))
            return concat([o.data async for o in talker.generate(call)])["codes"].tolist()

        with logits_positions(talker.model.codec_head) as positions:  # type: ignore[attr-defined]
            alone = [await talk(t) for t in thoughts]
            copies, _, keys = slot_table(talker)
            prefills = talker.prefills  # type: ignore[attr-defined]
            before = Counter(prefills.calls)
            together = await asked_while_held(talker, prefills, [talk(t) for t in thoughts])
        assert slot_table(talker) == (copies + 3, 0, keys)
        assert positions and set(positions) == {1}, positions
        await thinker.close()
        await talker.close()
        return alone, together, ran(prefills, before)

    alone, together, prefills = asyncio.run(go())
    assert prefills == [1, 2], prefills
    assert all(len(c) > 4 for c in alone)
    assert together == alone
