"""Qwen3-Omni's thinker and its encoder stage: the prompt as `Qwen3OmniMoeProcessor` builds it,
and what the talker reads of it (see the package's docstring)."""

from __future__ import annotations

from typing import Any

import torch

from omni_pipeline.payloads import ThinkerStep, declared
from omni_stage.engines.base import EngineError
from omni_stage.models.qwen_omni.audio_features import AudioFeatures
from omni_stage.models.qwen_omni.encoder import Encoder
from omni_stage.models.qwen_omni.prefill import PrefillInputs
from omni_stage.models.qwen_omni.prompt import LAYOUT_KEYS, MediaEmbeds, Prompt, Prompts
from omni_stage.models.qwen_omni.thinker import Thinker


class Qwen3AudioFeatures(AudioFeatures):
    """Qwen3-Omni's processor pads its clips to the longest, not to a 300 s window."""

    def of(self, audios: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """As the processor calls the feature extractor: padded to the longest clip, whole."""
        fe = self.extractor
        out = fe(
            audios,
            sampling_rate=fe.sampling_rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return out["input_features"], out["attention_mask"]


class Qwen3Prompts(Prompts):
    """The prompt as `Qwen3OmniMoeProcessor` builds it."""

    audio_class = Qwen3AudioFeatures

    def __init__(
        self, path: str, tokenizer: Any, thinker_config: Any, device: torch.device, dtype: torch.dtype
    ):
        super().__init__(path, tokenizer, thinker_config, device, dtype)
        self.n_window = int(thinker_config.audio_config.n_window)

    @staticmethod
    def _processor_defaults() -> dict[str, Any]:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessorKwargs

        return Qwen3OmniMoeProcessorKwargs._defaults

    def audio_tokens(self, lengths: torch.Tensor) -> list[int]:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        return _get_feat_extract_output_lengths(lengths, self.n_window).tolist()


class Qwen3PrefillInputs(PrefillInputs):
    """Qwen3-Omni's thinker takes an encoder stage's vision rows with their deepstack features."""

    def media_inputs(self, ids: torch.Tensor, media: MediaEmbeds) -> dict[str, Any]:
        """The audio rows at their placeholders of the input embeddings (as the forward puts
        its audio encoder's), and the image and video rows with their deepstack features
        through the forward's own seam for precomputed vision outputs (`mm_encoder_outputs`)."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            BaseModelOutputWithDeepstackFeatures,
        )

        m = self.model
        embeds = m.get_input_embeddings()(ids)
        if media.audio is not None:
            _, _, audio_mask = m.get_placeholder_mask(ids, inputs_embeds=embeds)
            embeds = embeds.masked_scatter(audio_mask, media.audio.to(self.device, embeds.dtype))
        _, image_sizes, video_sizes = self.prompts.layout_tokens(media.layout)
        vision: dict[str, Any] = {}
        for kind, rows, deep, sizes in (
            ("image", media.image, media.image_deepstack, image_sizes),
            ("video", media.video, media.video_deepstack, video_sizes),
        ):
            if rows is not None and deep is None:
                raise EngineError(
                    f"stage '{self.stage}': the encoder's {kind} rows came without deepstack features"
                )
            if rows is not None:
                vision[kind] = BaseModelOutputWithDeepstackFeatures(
                    pooler_output=torch.split(rows.to(self.device, self.dtype), sizes),
                    deepstack_features=[torch.split(d.to(self.device, self.dtype), sizes) for d in deep],
                )
        return {"input_ids": ids, "inputs_embeds": embeds, "mm_encoder_outputs": vision}


class Qwen3Thinker(Thinker):
    """Qwen2.5-Omni's thinker stage on Qwen3-Omni's MoE thinker, sending what its talker reads."""

    config_class = "Qwen3OmniMoeConfig"
    model_name = "Qwen3-Omni"
    prompts_class = Qwen3Prompts
    sends_reply_hidden = False
    prefill_class = Qwen3PrefillInputs

    def _part_class(self) -> tuple[Any, Any]:
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        return Qwen3OmniMoeThinkerForConditionalGeneration, self.config.thinker_config

    @property
    def talker_layer(self) -> int:
        return int(self.config.talker_config.accept_hidden_layer)

    def _prompt_extras(self, prompt: Prompt) -> ThinkerStep:
        """The prompt's ids and its media's layout, each as one unit ([1, ...])."""
        out = ThinkerStep(prompt_ids=prompt.ids.cpu())
        for key in LAYOUT_KEYS:
            if (value := getattr(prompt.layout, key)) is not None:
                out[declared(f"prompt_{key}")] = value.cpu()[None]
        return out


class Qwen3Encoder(Encoder):
    """Qwen3-Omni's audio and vision encoders as a stage of their own (qwen_omni_encoder.py);
    its vision encoder's deepstack features go to the thinker with the rows."""

    config_class = "Qwen3OmniMoeConfig"
    model_name = "Qwen3-Omni"
    prompts_class = Qwen3Prompts

    def _tower_classes(self) -> tuple[Any, Any]:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeAudioEncoder,
            Qwen3OmniMoeVisionEncoder,
        )

        return Qwen3OmniMoeAudioEncoder, Qwen3OmniMoeVisionEncoder

    def _audio_tower(self, packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.audio_tower(packed, feature_lens=lengths).last_hidden_state
