"""The Batch API's request bodies: a batch to create (JSON) and a file's upload form's fields."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS: Final = (
    "/v1/chat/completions",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
    "/v1/audio/speech",
)
"""What a batch may run here: OpenAI's batchable endpoints this gateway serves, and
/v1/audio/speech (its audio as base64 in the output line: an extension). An edit's line is
OpenAI's JSON edit (images as `image_url`s); a video line makes a job and ends when the job
does (its output line the finished job)."""


class ExpiresAfter(BaseModel):
    """OpenAI's `expires_after`: `seconds` after the object's `created_at`."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 86400)


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None

    def model_post_init(self, _: object) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"endpoint: {self.endpoint!r} cannot be batched here; one of {', '.join(ENDPOINTS)}"
            )


class FileUploadFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    purpose: Literal["batch"] = Field(description="Only `batch`: files here are batches' input.")
    expires_after: ExpiresAfter | None = None
