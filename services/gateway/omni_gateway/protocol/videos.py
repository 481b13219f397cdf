"""POST /v1/videos (and vLLM-Omni's /v1/videos/sync, /v1/videos/{id}/remix): the request
model, read from a multipart form (as the openai SDK sends it) or JSON, and what the pipeline
gets of it."""

from __future__ import annotations

import secrets
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.datastructures import UploadFile
from starlette.requests import Request

from omni_gateway.errors import BadRequest
from omni_gateway.protocol.common import json_object, parse
from omni_pipeline.control import RequestInputs
from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import OutputKind

MAX_VIDEO_SIDE: Final = 4096
MAX_SECONDS: Final = 600.0


class VideoCreateRequest(BaseModel):
    """OpenAI's fields (prompt, model, seconds, size, input_reference), vLLM-Omni's diffusion
    ones (width, height, fps, num_frames, negative_prompt, num_inference_steps,
    guidance_scale, seed) and vLLM's `priority`. `seconds` may be any length the model can
    make, not only OpenAI's 4, 8, 12. An unknown field is a 400; `user` concerns OpenAI's
    platform and is ignored."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=32000)
    model: str | None = None
    seconds: str | None = Field(default=None, pattern=r"^[0-9]{1,4}(\.[0-9]{1,3})?$")
    size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")
    width: int | None = Field(default=None, ge=1, le=MAX_VIDEO_SIDE)
    height: int | None = Field(default=None, ge=1, le=MAX_VIDEO_SIDE)
    fps: int | None = Field(default=None, ge=1, le=60)
    num_frames: int | None = Field(default=None, ge=1, le=10000)
    negative_prompt: str | None = Field(default=None, max_length=32000)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    input_reference: Any = None
    user: str | None = None
    priority: int = Field(
        default=0,
        ge=-(2**31),
        lt=2**31,
        description="vLLM's: a replica starts its waiting requests the lower value first, then in order.",
    )

    @field_validator("input_reference")
    @classmethod
    def _no_reference(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("this model makes video from text only (it has no image-to-video)")

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_as_text(cls, v: Any) -> Any:
        """OpenAI's schema has it a string ("4"); a JSON client's number means the same."""
        return f"{v:g}" if isinstance(v, int | float) and not isinstance(v, bool) else v

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, v: str | None) -> str | None:
        if v is not None and not 0 < float(v) <= MAX_SECONDS:
            raise ValueError(f"from more than 0 to {MAX_SECONDS:g}")
        return v

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and not all(1 <= int(x) <= MAX_VIDEO_SIDE for x in v.split("x")):
            raise ValueError(f"width and height must be from 1 to {MAX_VIDEO_SIDE}")
        return v

    @model_validator(mode="after")
    def _one_size(self) -> VideoCreateRequest:
        if self.size is not None and (self.width is not None or self.height is not None):
            raise ValueError("size: give size or width and height, not both")
        if self.seconds is not None and self.num_frames is not None:
            raise ValueError("seconds: give seconds or num_frames, not both")
        return self

    def width_height(self) -> tuple[int | None, int | None]:
        if self.size is not None:
            w, h = self.size.split("x")
            return int(w), int(h)
        return self.width, self.height

    def seeded(self) -> VideoCreateRequest:
        """This request with its seed drawn now if it has none: a job taken up again after a
        restart, or remixed, starts from the same noise."""
        return self if self.seed is not None else self.model_copy(update={"seed": secrets.randbits(63)})


class VideoRemixRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=32000)


ListOrder = Literal["asc", "desc"]


async def read_video_request(request: Request) -> VideoCreateRequest:
    """The request's body as a VideoCreateRequest: a multipart form (an uploaded
    `input_reference` counts as given) or JSON; a 400 names the field at fault."""
    kind = request.headers.get("content-type", "")
    fields: dict[str, Any]
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        async with request.form() as form:
            fields = {}
            for key, value in form.multi_items():
                if key in fields:
                    raise BadRequest(f"{key}: given more than once", param=key)
                fields[key] = "<file>" if isinstance(value, UploadFile) else value
    else:
        fields = await json_object(request, "the body is neither JSON nor a multipart form")
    return parse(VideoCreateRequest, fields)


def video_inputs(req: VideoCreateRequest) -> RequestInputs:
    return RequestInputs(
        modalities=[OutputKind.VIDEO.value], prompt=req.prompt, negative_prompt=req.negative_prompt or None
    )


def video_sampling(req: VideoCreateRequest, progress: bool) -> Sampling:
    """What the stages get; `progress`: the denoiser reports every step (a job shows it)."""
    width, height = req.width_height()
    params: dict[str, Any] = {
        "width": width,
        "height": height,
        "seconds": float(req.seconds) if req.seconds is not None else None,
        "fps": req.fps,
        "num_frames": req.num_frames,
        "seed": req.seed,
        "num_inference_steps": req.num_inference_steps,
        "guidance_scale": req.guidance_scale,
        "progress": progress or None,
    }
    return Sampling(**{k: v for k, v in params.items() if v is not None})
