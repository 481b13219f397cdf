"""What a thinker's prefill feeds its forward: the prompt's M-RoPE positions and the offset its
decoding keeps, without the positions a conversation's kept sequence holds, and its media as
the forward takes them: features it encodes itself, an encoder stage's outputs at their
placeholders, or a live session's audio as it was encoded on arrival (audio_ahead.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_stage.engines.audio_ahead import AudioAhead
from omni_stage.models.qwen_omni.prompt import MediaEmbeds, Prompt, Prompts


@dataclass(frozen=True, slots=True)
class Prefill:
    """A prompt's prefill: the prompt from the first position it computes, those positions'
    ids ([3, 1, n]), the offset of the M-RoPE positions its decoding keeps, and the forward's
    inputs."""

    prompt: Prompt
    positions: torch.Tensor
    rope_deltas: torch.Tensor
    inputs: dict[str, Any]


class PrefillInputs:
    """A thinker's prefills, on its loaded `model` (built at each load)."""

    def __init__(
        self,
        model: Any,
        prompts: Prompts,
        audio_ahead: AudioAhead | None,
        device: torch.device,
        dtype: torch.dtype,
        stage: str,
    ) -> None:
        self.model = model
        self.prompts = prompts
        self.audio_ahead = audio_ahead
        self.device = device
        self.dtype = dtype
        self.stage = stage

    def of(self, prompt: Prompt, start: int, ahead: dict[bytes, torch.Tensor]) -> Prefill:
        """`prompt`'s prefill past its first `start` positions (a kept sequence holds those),
        with `ahead`, a live session's audio windows encoded as they arrived, by digest."""
        ids, lay = prompt.ids, prompt.layout
        positions, deltas = self.model.get_rope_index(
            ids,
            lay.image_grid_thw,
            lay.video_grid_thw,
            torch.ones_like(ids),
            False,
            lay.audio_lengths,
            lay.video_second_per_grid,
        )
        if start:  # the rest alone, at their positions in the whole prompt
            prompt = self.prompts.after(prompt, start)
            ids, positions = prompt.ids, positions[..., start:]
        if prompt.embeds is not None:
            inputs = self.media_inputs(ids, prompt.embeds)
        elif ahead and "input_features" in prompt.features:
            inputs = self._with_audio_ahead(ids, prompt, ahead)
        else:
            inputs = {"input_ids": ids} | prompt.features
        return Prefill(prompt, positions, deltas, inputs)

    def _with_audio_ahead(
        self, ids: torch.Tensor, prompt: Prompt, ahead: dict[bytes, torch.Tensor]
    ) -> dict[str, Any]:
        """The inputs with the audio encoded window by window, taking the windows a live
        session's audio was encoded into ahead where they are equal; the other media's
        features as they are (the model's forward encodes those)."""
        assert self.audio_ahead is not None
        others = dict(prompt.features)
        feats, mask = others.pop("input_features"), others.pop("feature_attention_mask")
        rows = self.audio_ahead.encoded(feats, mask.sum(-1).tolist(), ahead)
        return self.media_inputs(ids, MediaEmbeds(rows, None, None, prompt.layout)) | others

    def media_inputs(self, ids: torch.Tensor, media: MediaEmbeds) -> dict[str, Any]:
        """The inputs with an encoder's outputs in place of the media: the prompt's input
        embeddings with them at the media's placeholders, what the model's forward makes of
        the encoders' outputs itself."""
        m = self.model
        embeds = m.get_input_embeddings()(ids)
        kinds = (media.image, media.video, media.audio)  # the order of the masks
        rows = [None if e is None else e.to(self.device, embeds.dtype) for e in kinds]
        masks = m.get_placeholder_mask(ids, embeds, image_features=rows[0], video_features=rows[1])
        for mask, e in zip(masks, rows, strict=True):
            if e is not None:
                embeds = embeds.masked_scatter(mask, e)
        return {"inputs_embeds": embeds}
