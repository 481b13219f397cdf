"""Which diffusers engine a stage runs: by its `role`, and by the model family its pipeline
directory holds (image.py's stages, video.py's, edit.py's image editing ones, text.py's text
encoder; what they share is in parts.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from omni_pipeline.spec import StageSpec
from omni_stage.engines.base import Engine, EngineError
from omni_stage.engines.diffusers.edit import EDIT_DENOISERS, EditDenoiseEngine, EditEncodeEngine
from omni_stage.engines.diffusers.image import DecodeEngine, DenoiseEngine
from omni_stage.engines.diffusers.text import TextEncodeEngine
from omni_stage.engines.diffusers.video import VIDEO_DENOISERS, VideoDecodeEngine, VideoDenoiseEngine

Family = Literal["image", "video", "edit"]


def family_of(path: Path) -> Family:
    """The model family of a pipeline directory, by its transformer's class."""
    try:
        entry = json.loads((path / "model_index.json").read_text()).get("transformer")
    except (OSError, ValueError, AttributeError):
        return "image"  # the engine's own loading says what is wrong with the directory
    cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    if cls in VIDEO_DENOISERS:
        return "video"
    if cls in EDIT_DENOISERS:
        return "edit"
    return "image"


def build_diffusers_engine(stage: StageSpec) -> Engine:
    """The engine of the stage's `role`, for the model family its pipeline directory holds."""
    role = stage.engine.args.get("role")
    family = family_of(Path(str(stage.engine.model)))
    if role == "encode":
        return EditEncodeEngine(stage) if family == "edit" else TextEncodeEngine(stage)
    if role == "denoise":
        return {"video": VideoDenoiseEngine, "edit": EditDenoiseEngine}.get(family, DenoiseEngine)(stage)
    if role == "decode":
        return VideoDecodeEngine(stage) if family == "video" else DecodeEngine(stage)
    raise EngineError(
        f"stage '{stage.name}': engine.args.role must be 'encode', 'denoise' or 'decode', got {role!r}"
    )
