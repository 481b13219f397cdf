"""POST /v1/images/generations and /v1/images/edits: their request models, and what the
pipeline gets of them."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from omni_gateway.protocol.common import refuse_unless_off
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind

MAX_IMAGE_SIDE = 4096
"""Largest width or height the gateway passes on; the model's own limit is usually lower."""


_IMAGE_OFF: Final[dict[str, tuple[Any, ...]]] = {
    "quality": ("auto",),
    "style": (),
    "background": ("auto", "opaque"),
}
"""Switches a diffusion model does not have, taken only at the values it gives anyway."""


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations: OpenAI's fields, and the diffusion ones it lacks (seed,
    num_inference_steps, guidance_scale, negative_prompt). quality, style and background are
    refused unless at what a diffusion model gives anyway (`_IMAGE_OFF`); `user` and
    `moderation` concern OpenAI's platform and are ignored; an unknown field is a 400."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=10)
    size: str | None = Field(default=None, pattern=r"^(auto|[0-9]{1,5}x[0-9]{1,5})$")
    response_format: str | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=10)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = Field(default=None, max_length=32000)
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    user: str | None = None
    moderation: str | None = None

    @field_validator(*_IMAGE_OFF, mode="before")
    @classmethod
    def _not_served(cls, v: Any, info: ValidationInfo) -> None:
        refuse_unless_off(v, info, _IMAGE_OFF)

    @field_validator("response_format")
    @classmethod
    def _b64_only(cls, v: str | None) -> str | None:
        if v not in (None, "b64_json"):
            raise ValueError(f"'{v}' is not served here; use b64_json")
        return v

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v not in (None, "auto") and not all(1 <= int(x) <= MAX_IMAGE_SIDE for x in v.split("x")):
            raise ValueError(f"width and height must be from 1 to {MAX_IMAGE_SIDE}")
        return v

    def width_height(self) -> tuple[int, int] | None:
        if self.size is None or self.size == "auto":
            return None
        w, h = self.size.split("x")
        return int(w), int(h)


_EDIT_OFF: Final[dict[str, tuple[Any, ...]]] = {"input_fidelity": ("low",)}
"""An edit's switches a diffusion model does not have (it keeps to the input as it does)."""


class ImageEditRequest(ImageGenerationRequest):
    """POST /v1/images/edits, the form's fields but its files (`image`, `mask`): those of a
    generation, and OpenAI's `input_fidelity` (refused unless `low`) and vLLM-Omni's
    `true_cfg_scale` (Qwen-Image-Edit's name for `guidance_scale`: one or the other)."""

    input_fidelity: str | None = None
    true_cfg_scale: float | None = Field(default=None, ge=0, le=100)

    @field_validator(*_EDIT_OFF, mode="before")
    @classmethod
    def _not_served_in_edits(cls, v: Any, info: ValidationInfo) -> None:
        refuse_unless_off(v, info, _EDIT_OFF)

    @field_validator("true_cfg_scale")
    @classmethod
    def _one_scale(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and info.data.get("guidance_scale") not in (None, v):
            raise ValueError("the same as guidance_scale; send one of them")
        return v

    @model_validator(mode="after")
    def _guidance_by_either_name(self) -> ImageEditRequest:
        if self.true_cfg_scale is not None:
            self.guidance_scale = self.true_cfg_scale
        return self


def image_inputs(req: ImageGenerationRequest, images: list[str] | None = None) -> RequestInputs:
    """`images`: for an edit, the references to its decoded images in the request's media."""
    return RequestInputs(
        modalities=[OutputKind.IMAGE.value],
        prompt=req.prompt,
        negative_prompt=req.negative_prompt or None,
        images=images,
    )


def image_sampling(req: ImageGenerationRequest) -> Sampling:
    """Previews are asked for only by a stream: a whole response would throw them away."""
    wh = req.width_height()
    params: dict[str, Any] = {
        "n": req.n,
        "width": wh[0] if wh else None,
        "height": wh[1] if wh else None,
        "seed": req.seed,
        "num_inference_steps": req.num_inference_steps,
        "guidance_scale": req.guidance_scale,
        "previews": req.stream or None,
        "partial_images": req.partial_images if req.stream else None,
    }
    return Sampling(**{k: v for k, v in params.items() if v is not None})
