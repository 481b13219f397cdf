"""Which diffusers engine a stage runs: by its `role`, and by the model family its pipeline
directory holds (diffusers.py's image stages, diffusers_video.py's video ones,
diffusers_text.py's text encoder)."""

from __future__ import annotations

from pathlib import Path

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import Engine, EngineError
from omni_stage.engines.diffusers import DecodeEngine, DenoiseEngine
from omni_stage.engines.diffusers_text import TextEncodeEngine
from omni_stage.engines.diffusers_video import VideoDecodeEngine, VideoDenoiseEngine, is_video_pipeline


def build_diffusers_engine(stage: StageSpec) -> Engine:
    """The engine of the stage's `role`, for the model family its pipeline directory holds (a
    video family's denoiser and VAE differ from an image family's)."""
    role = stage.engine.args.get("role")
    video = is_video_pipeline(Path(str(stage.engine.model)))
    if role == "encode":
        return TextEncodeEngine(stage)
    if role == "denoise":
        return VideoDenoiseEngine(stage) if video else DenoiseEngine(stage)
    if role == "decode":
        return VideoDecodeEngine(stage) if video else DecodeEngine(stage)
    raise EngineError(
        f"stage '{stage.name}': engine.args.role must be 'encode', 'denoise' or 'decode', got {role!r}"
    )
