"""tiny-qwen2.5-omni has what a real Qwen2.5-Omni checkpoint has, and loads with transformers'
own classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def path(demo_dir: Path) -> Path:
    return demo_dir / "models" / "tiny-qwen2.5-omni"


def test_it_loads_as_the_whole_model_with_its_voices(path: Path) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path)
    assert sorted(model.speaker_map) == ["Chelsie", "Ethan"]
    text = model.config.thinker_config.text_config
    assert text.hidden_size // text.num_attention_heads >= 32  # the least vLLM's CPU attention takes
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "spk_dict.pt"):
        assert (path / f).is_file(), f


def test_its_tokenizer_knows_qwens_media_tokens_and_template(path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.audio_token, tok.image_token, tok.video_token) == ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")
    assert (tok.vision_bos_token, tok.audio_eos_token) == ("<|vision_bos|>", "<|audio_eos|>")
    parts = [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "hi"}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    assert "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>hi" in text
    assert text.startswith("<|im_start|>system\nYou are Qwen")


def test_its_audio_and_image_processors_load(path: Path) -> None:
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    audio = WhisperFeatureExtractor.from_pretrained(path)
    features = audio(torch.zeros(16000).numpy(), sampling_rate=16000, return_tensors="pt")
    assert features["input_features"].shape[1] == 128
    image = Qwen2VLImageProcessorPil.from_pretrained(path)
    out = image(torch.zeros(56, 56, 3, dtype=torch.uint8).numpy(), return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_it_loads_with_the_omni_processor(path: Path) -> None:
    from transformers import Qwen2_5OmniProcessor

    processor = Qwen2_5OmniProcessor.from_pretrained(path)
    assert processor.tokenizer.audio_token == "<|AUDIO|>"
