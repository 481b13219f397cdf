"""The reference every Qwen2.5-Omni test compares with: transformers' own
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`, greedy, as its
documentation runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def reference_generate(
    path: Path, messages: list[dict[str, Any]], thinker_tokens: int, talker_codes: int, seed: int, voice: str
) -> dict[str, Any]:
    """The reply's token ids and text, the talker's codes (as its token2wav receives them) and
    the waveform. `torch.manual_seed(seed)` goes right before generate: greedy decoding draws
    nothing, so the DiT's starting noise is the first random draw after it."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), return_tensors="pt"
    )
    seen: dict[str, torch.Tensor] = {}

    def keep_codes(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen["codes"] = args[0][0].clone()

    ref.token2wav.register_forward_pre_hook(keep_codes)
    talker = ref.config.talker_config
    torch.manual_seed(seed)
    seq, wav = ref.generate(
        ids["input_ids"],
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
