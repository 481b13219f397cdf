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


# What the real checkpoints' files hold, written down from them (Qwen/Qwen2.5-Omni-7B,
# Qwen/Qwen3-Omni-30B-A3B-Instruct: tokenizer and config files, spk_dict.pt), as far as a tiny
# model of the same architecture can hold the same: every special token its own id, the config's
# token ids naming those tokens, speaker conditioning in a batch of one.
QWEN2_5_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>",
    "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>", "<|spk_chelsie|>", "<|spk_ethan|>",
]  # fmt: skip
QWEN3_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
]  # fmt: skip


def own_ids(path: Path, tokens: list[str]) -> dict[str, int]:
    """Each token's id, checked to be its own: not <unk>, not shared, inside the vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tokens}
    assert tok.unk_token_id not in ids.values(), {t: i for t, i in ids.items() if i == tok.unk_token_id}
    assert len(set(ids.values())) == len(ids) and max(ids.values()) < len(tok)
    return ids


def test_every_special_token_has_its_own_id_and_the_config_names_them(path: Path) -> None:
    import json

    ids = own_ids(path, QWEN2_5_SPECIAL)
    config = json.loads((path / "config.json").read_text())
    talker, thinker = config["talker_config"], config["thinker_config"]
    assert (
        talker["tts_text_start_token_id"],
        talker["tts_text_end_token_id"],
        talker["tts_text_pad_token_id"],
    ) == (
        ids["<|tts_text_bos|>"],
        ids["<|tts_text_eod|>"],
        ids["<|tts_pad|>"],
    )
    assert (thinker["audio_token_index"], thinker["image_token_index"], thinker["video_token_index"]) == (
        ids["<|AUDIO|>"],
        ids["<|IMAGE|>"],
        ids["<|VIDEO|>"],
    )
    assert thinker["user_token_id"] == ids["<|im_start|>"]


def test_the_speaker_file_has_the_real_files_structure(path: Path) -> None:
    """spk_dict.pt: per voice its text bos token (the voice's own special token), `cond` [1, dim]
    and `ref_mel` [1, frames, 80], float32: what vLLM-Omni's loader, proven on the real file,
    reads."""
    ids = own_ids(path, QWEN2_5_SPECIAL)
    speakers = torch.load(path / "spk_dict.pt", weights_only=True)
    assert sorted(speakers) == ["Chelsie", "Ethan"]
    for voice, s in speakers.items():
        assert set(s) == {"bos_token", "cond", "ref_mel"}
        assert s["bos_token"] == ids[f"<|spk_{voice.lower()}|>"]
        assert s["cond"].dim() == 2 and s["cond"].shape[0] == 1 and s["cond"].dtype == torch.float32
        assert s["ref_mel"].dim() == 3 and s["ref_mel"].shape[::2] == (1, 80)
        assert s["ref_mel"].dtype == torch.float32


def test_qwen3_omni_special_tokens_and_speakers_are_the_real_ones(demo_dir: Path) -> None:
    import json

    path = demo_dir / "models" / "tiny-qwen3-omni"
    ids = own_ids(path, QWEN3_SPECIAL)
    config = json.loads((path / "config.json").read_text())
    talker = config["talker_config"]
    assert (config["tts_bos_token_id"], config["tts_eos_token_id"], config["tts_pad_token_id"]) == (
        ids["<|tts_bos|>"],
        ids["<|tts_eos|>"],
        ids["<|tts_pad|>"],
    )
    assert talker["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}  # codec ids, as real
    assert all(code < talker["text_config"]["vocab_size"] for code in talker["speaker_id"].values())
