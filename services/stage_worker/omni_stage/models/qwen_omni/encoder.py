"""Qwen2.5-Omni's audio and vision encoders as a stage of their own: the E of an
encode / prefill / decode split.

`engine: {kind: transformers, model: DIR, args: {part: encoder}}`, in front of the thinker
(`inputs: [{from: request}, {from: encoder}]` on the thinker; `skipWithoutMedia: true` here,
so a request without media never waits for it). It loads only the thinker's audio tower and
vision tower (transformers' own classes, their weights read alone from the checkpoint), runs
the model's processors on the request's media and then the encoders, the media of concurrent
requests stacked into one call per encoder, and sends each request's embeddings with their
layout (`MediaEmbeds`) through the edge's connector. The thinker puts them at the media's
placeholders instead of running its own encoders: the same numbers its forward would compute
(tests/unit/test_qwen_omni_encoder.py), so the same tokens.

The edge to the thinker must be a full window (the default): one request's embeddings are one
unit, of whatever length each kind's rows have.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.batching import StepBatcher
from omni_stage.models.qwen_omni.parts import Part
from omni_stage.models.qwen_omni.prompt import EncoderInputs, MediaEmbeds, Prompts
from omni_stage.segments import EngineOutput


class Encoder(Part):
    part = "encoder"
    weights = ("audio_tower", "visual")
    prompts_class = Prompts

    def _tower_classes(self) -> tuple[Any, Any]:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
            Qwen2_5OmniVisionEncoder,
        )

        return Qwen2_5OmniAudioEncoder, Qwen2_5OmniVisionEncoder

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.prompts: Prompts | None = None
        self.audio_tower: Any = None
        self.visual: Any = None
        self.batcher = StepBatcher(self._encode, self._compute, self.max_batch)

    def _load(self) -> None:
        from transformers import AutoTokenizer

        self._read_config()
        c = self.config.thinker_config
        audio, vision = self._tower_classes()
        self.audio_tower = self._from_checkpoint(audio, c.audio_config, r"^thinker\.audio_tower\.")
        self.visual = self._from_checkpoint(vision, c.vision_config, r"^thinker\.visual\.")
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.prompts = self.prompts_class(self.path, tokenizer, c, self.device, self.dtype)
        self.accepts = self.prompts.accepts
        self._hear_ahead(self.prompts, lambda: self.audio_tower)

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request")
        if request is None or "messages" not in request:
            raise EngineError(f"stage '{self.stage.name}': the encoder reads the client's messages")
        assert self.prompts is not None
        inputs = await self._build(lambda: self.prompts.process(self.prompts.read(request), call.sampling))
        if not inputs.features:
            return  # no media in the messages: nothing to encode (the route normally skips us)
        key = call.sampling.prompt_cache_key
        ahead = {}
        if key is not None and self.audio_ahead is not None and "input_features" in inputs.features:
            ahead = await self.audio_ahead.take(str(key))
        embeds = await self.batcher.submit("encode", Encoding(inputs, ahead))
        yield EngineOutput(units=1, data=embeds.to_payload(), finish_reason="stop")

    @torch.inference_mode()
    def _encode(self, batch: list[Encoding]) -> list[MediaEmbeds]:
        """Every request's media through each encoder at once, split back per request; the
        audio of a request with windows encoded ahead window by window instead, taking them."""
        hearing = [e for e in batch if "input_features" in e.inputs.features]
        together = iter(self._audio([e.inputs.features for e in hearing if not e.ahead]))
        audio = {id(e): self._audio_ahead_rows(e) if e.ahead else next(together) for e in hearing}
        inputs = [e.inputs for e in batch]
        image = self._vision([b.features for b in inputs], "pixel_values", "image_grid_thw")
        video = self._vision([b.features for b in inputs], "pixel_values_videos", "video_grid_thw")
        out = []
        for e, b in zip(batch, inputs, strict=True):
            a = audio.get(id(e))
            i, i_deep = image.pop(0) if "pixel_values" in b.features else (None, None)
            v, v_deep = video.pop(0) if "pixel_values_videos" in b.features else (None, None)
            out.append(MediaEmbeds(a, i, v, b.layout, i_deep, v_deep))  # the processors' layout: on the CPU
        return out

    def _audio_ahead_rows(self, e: Encoding) -> torch.Tensor:
        assert self.audio_ahead is not None
        f = e.inputs.features
        lengths = f["feature_attention_mask"].sum(-1).tolist()
        feats = f["input_features"].to(self.device, self.dtype)
        return self.audio_ahead.encoded(feats, lengths, e.ahead).cpu()

    def _audio(self, features: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each request's audio rows: `get_audio_features` of the model's thinker, on the
        requests' clips together."""
        if not features:
            return []
        # Each request's features span its own longest clip: pad all to the longest (frames the
        # masks leave out, as the model's 300 s window does).
        frames = max(f["input_features"].shape[-1] for f in features)
        pad = lambda t: torch.nn.functional.pad(t, (0, frames - t.shape[-1]))  # noqa: E731
        feats = torch.cat([pad(f["input_features"]) for f in features]).to(self.device, self.dtype)
        mask = torch.cat([pad(f["feature_attention_mask"]) for f in features]).to(self.device)
        lengths = mask.sum(-1)
        packed = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        rows = self._audio_tower(packed, lengths)
        assert self.prompts is not None
        per_request = [sum(self.prompts.audio_tokens(f["feature_attention_mask"].sum(-1))) for f in features]
        return [r.cpu() for r in torch.split(rows, per_request)]

    def _audio_tower(self, packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        after_cnn, _ = self.audio_tower._get_feat_extract_output_lengths(lengths)
        return self.audio_tower(packed, feature_lens=lengths, aftercnn_lens=after_cnn).last_hidden_state

    def _vision(
        self, features: list[dict[str, torch.Tensor]], pixels: str, grid: str
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each request's image (or video) rows, and the deepstack features Qwen3-Omni's
        thinker adds in its first layers ([layers, rows, hidden]; None for Qwen2.5-Omni): the
        vision tower on the requests' pixels together."""
        having = [f for f in features if pixels in f]
        if not having:
            return []
        grids = torch.cat([f[grid] for f in having]).to(self.device)
        values = torch.cat([f[pixels] for f in having]).to(self.device, self.dtype)
        out = self.visual(values, grid_thw=grids)
        merge = self.visual.spatial_merge_size**2
        per_request = [int(f[grid].prod(-1).sum()) // merge for f in having]
        rows = [r.cpu() for r in torch.split(out.pooler_output, per_request)]
        deep = getattr(out, "deepstack_features", None)
        if not deep:
            return [(r, None) for r in rows]
        stacked = [d.cpu() for d in torch.split(torch.stack(list(deep)), per_request, dim=1)]
        return list(zip(rows, stacked, strict=True))


@dataclass(frozen=True, slots=True)
class Encoding:
    """One request's media to encode, and its live session's audio windows encoded ahead."""

    inputs: EncoderInputs
    ahead: dict[bytes, torch.Tensor]
