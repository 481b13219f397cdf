"""What Qwen3-TTS's talker is fed: the assistant turn's start, the codec's control codes (think,
language) and the voice (a named speaker's codec row, or a cloned voice's x-vector in its place);
then the text, in one of the reference's two layouts: streaming (the text's first token in the
prompt, the rest a token a step beside each frame's codes) or non-streaming (the whole text and
the TTS eos in the prompt, the steps fed the TTS pad: the reference's default for named and
described voices). A voice cloned in context puts the clip's transcript before the text and the
clip's codes beside it, as if the talker had spoken the clip itself and goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_stage.models.qwen3_omni.code_predictor import frames_embedding
from omni_stage.models.qwen3_tts.cloning import ClonedVoice
from omni_stage.models.qwen3_tts.modeling import Talker

TURN_END = 5
"""The ids after the text: `<|im_end|>`, a newline, `<|im_start|>`, `assistant`, a newline."""
TRANSCRIPT_END = 2
"""The ids after a cloned clip's transcript: `<|im_end|>`, a newline."""


@dataclass(frozen=True, slots=True)
class TTSIds:
    """The ids a prompt is laid out by: the TTS tokens (text vocabulary), the codec's control
    codes, and its languages and speakers by name (lower case, as config.json has them)."""

    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    languages: dict[str, int]
    speakers: dict[str, int]
    dialects: dict[str, str]
    """A speaker's dialect: the language it speaks Chinese (or Auto) in."""

    @classmethod
    def of(cls, config: dict[str, Any]) -> TTSIds:
        t = config["talker_config"]
        return cls(
            tts_bos=config["tts_bos_token_id"],
            tts_eos=config["tts_eos_token_id"],
            tts_pad=config["tts_pad_token_id"],
            codec_pad=t["codec_pad_id"],
            codec_bos=t["codec_bos_id"],
            codec_eos=t["codec_eos_token_id"],
            think=t["codec_think_id"],
            nothink=t["codec_nothink_id"],
            think_bos=t["codec_think_bos_id"],
            think_eos=t["codec_think_eos_id"],
            languages=dict(t.get("codec_language_id") or {}),
            speakers=dict(t.get("spk_id") or {}),
            dialects={s: d for s, d in (t.get("spk_is_dialect") or {}).items() if d},
        )

    def language_code(self, language: str, speaker: str | None) -> int | None:
        """The codec's code for `language` (None: Auto); a dialect speaker's own for Chinese."""
        lang = language.lower()
        if speaker and lang in ("chinese", "auto") and speaker.lower() in self.dialects:
            return self.languages[self.dialects[speaker.lower()]]
        return None if lang == "auto" else self.languages[lang]


@dataclass(frozen=True, slots=True)
class TTSPrompt:
    """The prefill's rows [1, L, H]; what each decode step adds to its frame's embedding, in turn
    (`trailing` [1, M, H]), and after them (`pad` [1, 1, H])."""

    inputs: torch.Tensor
    trailing: torch.Tensor
    pad: torch.Tensor


def tts_prompt(
    talker: Talker,
    ids: TTSIds,
    text_ids: torch.Tensor,
    language: str,
    speaker: str | ClonedVoice | None,
    instruct_ids: torch.Tensor | None = None,
    non_streaming: bool = True,
) -> TTSPrompt:
    """`text_ids` [1, T]: the assistant turn as the reference tokenizes it (`<|im_start|>assistant\\n`,
    the text, `<|im_end|>\\n<|im_start|>assistant\\n`); `speaker`: a named speaker (its codec row is
    the voice), a cloned voice, or None (a voice described by `instruct_ids`); `instruct_ids`:
    the instruction's user turn, which goes first; `non_streaming`: the whole text in the prompt
    (the reference's `non_streaming_mode`)."""
    device = talker.codec_head.weight.device
    text_ids = text_ids.to(device)

    def codec(*codes: int) -> torch.Tensor:
        return talker.get_input_embeddings()(torch.tensor([codes], device=device))

    tts = torch.tensor([[ids.tts_bos, ids.tts_eos, ids.tts_pad]], device=device)
    bos, eos, pad = talker.text(tts).chunk(3, dim=1)
    named = speaker if isinstance(speaker, str) else None
    language_code = ids.language_code(language, named)
    if language_code is None:
        think = codec(ids.nothink, ids.think_bos, ids.think_eos)
    else:
        think = codec(ids.think, ids.think_bos, language_code, ids.think_eos)
    if isinstance(speaker, ClonedVoice):
        voice = [speaker.x_vector.to(device, bos.dtype).view(1, 1, -1)]
    else:
        voice = [] if named is None else [codec(ids.speakers[named.lower()])]
    codes = torch.cat([think, *voice, codec(ids.codec_pad, ids.codec_bos)], dim=1)
    role = talker.text(text_ids[:, :3])
    start = torch.cat([pad.expand(-1, codes.shape[1] - 2, -1), bos], dim=1) + codes[:, :-1]
    instruct = [] if instruct_ids is None else [talker.text(instruct_ids.to(device))]
    head = [*instruct, role, start]
    if isinstance(speaker, ClonedVoice) and speaker.codes is not None:
        return _in_context(talker, ids, speaker, text_ids, head, eos, pad, non_streaming)
    if non_streaming:
        text = torch.cat([talker.text(text_ids[:, 3:-TURN_END]), eos], dim=1)
        text = text + codec(*[ids.codec_pad] * text.shape[1])
        rows = [*head, text, pad + codec(ids.codec_bos)]
        return TTSPrompt(torch.cat(rows, dim=1), pad[:, :0], pad)
    first = talker.text(text_ids[:, 3:4]) + codes[:, -1:]
    trailing = torch.cat([talker.text(text_ids[:, 4:-TURN_END]), eos], dim=1)
    return TTSPrompt(torch.cat([*head, first], dim=1), trailing, pad)


def _in_context(
    talker: Talker,
    ids: TTSIds,
    voice: ClonedVoice,
    text_ids: torch.Tensor,
    head: list[torch.Tensor],
    eos: torch.Tensor,
    pad: torch.Tensor,
    non_streaming: bool,
) -> TTSPrompt:
    """The prompt's end for a voice cloned in context: the transcript's and the text's rows, and
    the codec's bos then the clip's frames, side by side (non-streaming: the text first, over
    the codec's pad, then the frames over the TTS pad)."""
    assert voice.codes is not None and voice.text_ids is not None
    device = text_ids.device

    def codec(*codes: int) -> torch.Tensor:
        return talker.get_input_embeddings()(torch.tensor([codes], device=device))

    words = torch.cat([voice.text_ids.to(device)[:, 3:-TRANSCRIPT_END], text_ids[:, 3:-TURN_END]], dim=1)
    text = torch.cat([talker.text(words), eos], dim=1)
    spoken = torch.cat([codec(ids.codec_bos), frames_embedding(talker, voice.codes.to(device))], dim=1)
    if non_streaming:
        rows = text + codec(*[ids.codec_pad] * text.shape[1])
        return TTSPrompt(torch.cat([*head, rows, spoken + pad], dim=1), pad[:, :0], pad)
    n = spoken.shape[1]
    if text.shape[1] > n:
        return TTSPrompt(torch.cat([*head, text[:, :n] + spoken], dim=1), text[:, n:], pad)
    text = torch.cat([text, pad.expand(-1, n - text.shape[1], -1)], dim=1)
    return TTSPrompt(torch.cat([*head, text + spoken], dim=1), pad[:, :0], pad)
