"""What `omni serve`'s fork server imports for a pipeline's stages (omni_stage.preload)."""

from __future__ import annotations

import importlib.util

from omni_pipeline.spec import EngineKind
from omni_stage.preload import BY_KIND, EVERY_STAGE, stage_modules


def test_only_what_the_pipelines_engine_kinds_import() -> None:
    assert stage_modules([EngineKind.SYNTHETIC, EngineKind.TORCH, EngineKind.VLLM]) == list(EVERY_STAGE)
    both = stage_modules([EngineKind.TRANSFORMERS, EngineKind.DIFFUSERS, EngineKind.TRANSFORMERS])
    assert both[: len(EVERY_STAGE)] == list(EVERY_STAGE) and len(both) == len(set(both))
    assert set(BY_KIND[EngineKind.TRANSFORMERS]) < set(both) and "diffusers" in both
    assert not any(m.startswith("vllm") for m in both)  # vLLM's threads and processes stay out of it


def test_every_module_named_exists() -> None:
    """The fork server skips a module it cannot import, silently: a name that a library's new
    version moved would only make stages start slower, so it is checked here."""
    named = {m for modules in BY_KIND.values() for m in modules} | set(EVERY_STAGE)
    assert all(importlib.util.find_spec(m) is not None for m in named), named
