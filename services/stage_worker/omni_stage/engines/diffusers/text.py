"""A diffusers pipeline's own text encoder as a stage (role `encode`): Wan's UMT5, loaded from
the pipeline directory's `text_encoder` and `tokenizer` parts as the pipeline loads them.

The prompt is cleaned and tokenized as the family's pipeline does (padded to `textLength`
tokens, the padding masked), and only its real tokens' last hidden states go downstream, as
`prompt_embeds` [1, tokens, hidden]: the denoiser pads them back with zeros, as the pipeline
feeds its transformer, so the wire carries no padding. The negative prompt is always encoded
(the empty string when the request has none), as Wan's pipeline does for guidance; a request
without guidance leaves it unread.

Arguments (`engine.args`): role, device, dtype, threads, textLength (default 512, the pipeline's
`max_sequence_length`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import torch

from omni_pipeline.payloads import PromptEmbeds
from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.engines.diffusers.parts import DiffusersPart
from omni_stage.segments import EngineOutput

TEXT_LENGTH: Final = 512
"""Wan's `max_sequence_length`: the tokens its text encoder reads and its transformer attends."""


def clean_prompt(prompt: str) -> str:
    """The prompt as Wan's pipeline reads it (its own cleaning: HTML entities, whitespace)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return str(prompt_clean(prompt))


class TextEncodeEngine(DiffusersPart):
    weights = ("text_encoder",)

    def __init__(self, stage: StageSpec) -> None:
        super().__init__(stage)
        self.text_length = int(self.args.get("textLength", TEXT_LENGTH))
        self.text_encoder: Any = None
        self.tokenizer: Any = None

    def _load(self) -> None:
        self.text_encoder = self._load_part("text_encoder")
        try:
            self.tokenizer = self._part_class("tokenizer").from_pretrained(self.path, subfolder="tokenizer")
        except (OSError, ValueError) as exc:
            raise EngineError(
                f"stage '{self.stage.name}': cannot load 'tokenizer' from {self.path}: {exc}"
            ) from exc

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineOutput]:
        request = call.inputs.get("request")
        if request is None or not isinstance(request.get("prompt"), str):
            raise EngineError(f"stage '{self.stage.name}': role encode reads a client request's prompt")
        self._active.add(call.request_id)
        try:
            embeds, tokens = await self._run(self._encode, str(request["prompt"]))
            negative, _ = await self._run(self._encode, str(request.get("negative_prompt") or ""))
        finally:
            self._active.discard(call.request_id)
        call.state.prompt_tokens = tokens
        yield EngineOutput(units=1, data=PromptEmbeds(prompt_embeds=embeds, negative_prompt_embeds=negative))

    @torch.inference_mode()
    def _encode(self, prompt: str) -> tuple[torch.Tensor, int]:
        """[1, tokens, hidden] for the prompt's real tokens, and how many there are."""
        t = self.tokenizer(
            [clean_prompt(prompt)],
            padding="max_length",
            max_length=self.text_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = t.attention_mask.to(self.device)
        states = self.text_encoder(t.input_ids.to(self.device), mask).last_hidden_state
        tokens = int(mask.gt(0).sum())
        self._steps += 1
        return states[:, :tokens].float().cpu(), tokens
