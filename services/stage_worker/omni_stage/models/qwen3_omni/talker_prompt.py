"""What Qwen3-Omni's talker is fed first: the thinker's prompt cut to its user turns (media rows
projected from the thinker's hidden states, text rows from its embeddings), then the assistant's
start on the codec's control codes and the voice, with their M-RoPE positions. As the reference
lays it out; the decode steps after it are the talker's (speech.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TalkerIds:
    """The token ids the talker's prompt is laid out by (the thinker's vocabulary), and the
    codec's control codes it starts on."""

    im_start: int
    assistant: int
    user: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    media: torch.Tensor
    """The audio, image and video placeholders: their rows are the thinker's hidden states."""
    think: tuple[int, int, int]
    """The codec's no-think, think-bos and think-eos codes."""
    codec_pad: int
    codec_bos: int

    @classmethod
    def of(cls, config: Any) -> TalkerIds:
        t, thinker = config.talker_config, config.thinker_config
        media = [thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id]
        return cls(
            im_start=config.im_start_token_id,
            assistant=config.assistant_token_id,
            user=config.user_token_id,
            tts_pad=config.tts_pad_token_id,
            tts_bos=config.tts_bos_token_id,
            tts_eos=config.tts_eos_token_id,
            media=torch.tensor(media),
            think=(t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id),
            codec_pad=t.codec_pad_id,
            codec_bos=t.codec_bos_id,
        )


@dataclass(frozen=True, slots=True)
class TalkerPrompt:
    """The prefill's input rows [1, L, H], their positions [4, 1, L] (text, then M-RoPE), the
    offset of the M-RoPE positions that decoding keeps, and the user turns' rows (what a
    conversation's next turn begins with)."""

    inputs: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    user_rows: torch.Tensor


def talker_prompt(
    model: Any,
    ids: TalkerIds,
    tts: dict[str, torch.Tensor],
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first_reply: torch.Tensor,
    speaker: int,
    layout: dict[str, torch.Tensor],
) -> TalkerPrompt:
    """The user turns, the assistant's start and the first reply token. `prompt` is the thinker's
    (ids, input embeddings, hidden states) on the talker's device and dtype; `tts` the projected
    TTS pad and bos rows; `first_reply` the first reply token's input embedding."""
    token_ids, embeds, hidden = prompt
    device, dtype = embeds.device, embeds.dtype
    n = len(token_ids)
    # The user turns: from each <|im_start|> whose role is the user's, to the next turn.
    starts = torch.where(token_ids == ids.im_start, torch.arange(n, device=device), -1)
    turn = torch.cummax(starts, 0).values.clamp_min(0)
    user = token_ids[(turn + 1).clamp_max(n - 1)] == ids.user
    media = torch.isin(token_ids, ids.media.to(device))
    # As the reference: each projection on its own rows of the whole prompt, then the user's.
    width = model.config.text_config.hidden_size
    projected = torch.empty(n, width, device=device, dtype=dtype)
    if media.any():
        projected[media] = model.hidden_projection(hidden[media])
    projected[~media] = model.text_projection(embeds[~media])
    user_rows = projected[user]
    # The assistant's start: its 3 tokens, 4 TTS pads, the TTS bos and the first reply token,
    # on the codec's control codes and the voice.
    at = int(torch.nonzero((token_ids[:-1] == ids.im_start) & (token_ids[1:] == ids.assistant))[-1])
    head = model.text_projection(torch.cat([embeds[at:], first_reply[None]]))
    text = torch.cat([head[:3], tts["tts_pad"][None].expand(4, -1), tts["tts_bos"][None], head[3:4]])
    control = torch.tensor([*ids.think, speaker, ids.codec_pad, ids.codec_bos], device=device)
    silent = torch.zeros(3, text.shape[-1], device=device, dtype=text.dtype)  # the assistant's 3 tokens
    codec = torch.cat([silent, model.get_input_embeddings()(control)])
    inputs = torch.cat([user_rows, text + codec])[None]
    talker_ids = torch.cat([token_ids[user], torch.full((9,), ids.tts_pad, device=device)])[None]
    positions, rope_delta = _positions(model, talker_ids, layout)
    return TalkerPrompt(inputs, positions, rope_delta, user_rows)


def _positions(
    model: Any, talker_ids: torch.Tensor, layout: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """[4, 1, L]: text positions, then the M-RoPE ones (from the media's layout, if any), as
    floats whatever the prompt (`get_rope_index` gives floats: a video's positions can fall
    between whole numbers; the model reads them as floats either way), so that a compiled
    talker has one form of a prompt, with media or not (TalkerSteps' steps the same)."""
    n, device = talker_ids.shape[1], talker_ids.device
    text = torch.arange(n, device=device, dtype=torch.float)[None]
    if not layout:
        return torch.cat([text[None], text[None].expand(3, -1, -1)]), 0
    rope, deltas = model.get_rope_index(
        talker_ids,
        layout.get("image_grid_thw"),
        layout.get("video_grid_thw"),
        torch.ones_like(talker_ids),
        False,
        layout.get("audio_lengths"),
        layout.get("video_second_per_grid"),
    )
    return torch.cat([text[None], rope.to(device)]), int(deltas.reshape(-1)[0])
