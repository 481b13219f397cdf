"""The tiny Qwen-Omni checkpoints are sensitive to their input: different prompts, images and
audio clips give different greedy replies within the first eight tokens, as transformers' own
thinker generates them. Otherwise a parity test on them would prove little: a stage that
dropped the image, or read the wrong clip, would still answer as the reference does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

FAMILIES = {"qwen2.5-omni": "Qwen2_5Omni", "qwen3-omni": "Qwen3OmniMoe"}
FIRST = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def thinker(request: pytest.FixtureRequest, demo_dir: Path) -> tuple[Any, Any]:
    """transformers' own thinker of the family's tiny checkpoint, and its processor."""
    import transformers

    path = demo_dir / "models" / f"tiny-{request.param}"
    family = FAMILIES[request.param]
    model = getattr(transformers, f"{family}ThinkerForConditionalGeneration").from_pretrained(
        path, key_mapping={"^thinker.": ""}
    )
    return model.eval(), getattr(transformers, f"{family}Processor").from_pretrained(path)


def reply(thinker: tuple[Any, Any], text: str, **media: Any) -> tuple[int, ...]:
    """The first greedy tokens of the reply to `text`, with an image or an audio clip."""
    model, proc = thinker
    content: list[dict[str, str]] = [{"type": "text", "text": text}]
    content += [{"type": "image"}] * len(media.get("images", [])) + [{"type": "audio"}] * len(
        media.get("audio", [])
    )
    prompt = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = proc(text=prompt, return_tensors="pt", **media)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=FIRST, do_sample=False)
    return tuple(out[0, inputs["input_ids"].shape[1] :].tolist())


def test_different_prompts_give_different_replies(thinker: tuple[Any, Any]) -> None:
    prompts = ["Hello!", "What is the capital of France?", "Write a poem about the sea.", "1 2 3 4"]
    replies = [reply(thinker, p) for p in prompts]
    assert len(set(replies)) == len(prompts), replies


def test_different_images_give_different_replies(thinker: tuple[Any, Any]) -> None:
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    images = [
        Image.new("RGB", (64, 64), (255, 0, 0)),
        Image.new("RGB", (64, 64), (0, 0, 255)),
        Image.fromarray(noise),
    ]
    replies = [reply(thinker, "What is this?", images=[image]) for image in images]
    assert len(set(replies)) == len(images), replies


def test_different_audio_gives_different_replies(thinker: tuple[Any, Any]) -> None:
    t = np.arange(16000, dtype=np.float32) / 16000
    noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    clips = [0.5 * np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 1000 * t), noise]
    replies = [reply(thinker, "What is this?", audio=[clip]) for clip in clips]
    assert len(set(replies)) == len(clips), replies


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_code_the_talker_emits_reads_as_a_special_token(family: str, demo_dir: Path) -> None:
    """As in the real checkpoints (special tokens at ~151k, codes below 8448 or 3072): every id
    the thinker's config names, and every special token, lies past the talker's codes, so a
    consumer that scans codes for media placeholders (vLLM-Omni's code2wav does) finds none."""
    import transformers

    path = demo_dir / "models" / f"tiny-{family}"
    config = transformers.AutoConfig.from_pretrained(path)
    codes = (
        config.talker_config.text_config.vocab_size
        if family == "qwen3-omni"
        else config.talker_config.vocab_size
    )
    tok = transformers.AutoTokenizer.from_pretrained(path)
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    named = {
        v
        for k, v in config.thinker_config.to_dict().items()
        if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)
    }
    assert named and named <= special, (named, special)
    assert min(special) >= codes, (min(special), codes)
    assert tok.decode(tok("Hello, world!")["input_ids"]) == "Hello, world!"  # printable pairs round-trip
