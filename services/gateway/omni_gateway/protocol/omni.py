"""vLLM-Omni's own endpoints: POST /v1/omni/sleep and /v1/omni/wakeup."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OmniSleepRequest(BaseModel):
    """POST /v1/omni/sleep, vLLM-Omni's body: `stage_ids` (its stage indices, or our names) and
    `level`; `mode` is vLLM's pause mode (default: `wait` at level 0, `abort` deeper, as the
    memory the requests use goes away)."""

    model_config = ConfigDict(extra="forbid")
    stage_ids: list[int | str] = Field(min_length=1, max_length=64)
    level: int = Field(default=2, ge=0, le=2)
    mode: Literal["abort", "wait"] | None = None

    @field_validator("mode", mode="before")
    @classmethod
    def _no_keep(cls, v: Any) -> Any:
        if v == "keep":
            raise ValueError(
                "'keep' is not served: a kept request would hold its other stages' slots while asleep"
            )
        return v

    def pause_mode(self) -> str:
        return self.mode or ("wait" if self.level == 0 else "abort")


class OmniWakeupRequest(BaseModel):
    """POST /v1/omni/wakeup, vLLM-Omni's body."""

    model_config = ConfigDict(extra="forbid")
    stage_ids: list[int | str] = Field(min_length=1, max_length=64)
