"""Which engine computes a stage: one table from the pipeline file's words to what builds it.

Entries name a module and an attribute, so a stage imports only its own engine's stack (vLLM,
diffusers, one model family) and no engine imports another through here. A model family
(`engine.args.part`) is picked by its checkpoint's `model_type`; a diffusion family (a diffusers
stage's `role`) by its pipeline directory's denoiser class. Adding one is one entry in FAMILIES
or DIFFUSERS_FAMILIES pointing at its parts and its tiny checkpoint's writer.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from omni_pipeline.spec import EngineKind, StageSpec
from omni_stage.engines.base import Engine, EngineError, import_object


@dataclass(frozen=True)
class Family:
    """A model family served as parts, one per stage (`engine.args.part`): one package under
    omni_stage.models, its parts and its tiny checkpoint's writer named here."""

    name: str
    parts: dict[EngineKind, dict[str, str]]
    """engine kind -> part -> `module:attribute` of the engine that computes it."""
    checkpoint: str
    """`module:attribute` of its tiny checkpoint's writer, `write(path: Path) -> Path` (random
    weights of the real architecture, every file a real checkpoint has)."""
    demo: str
    """The name `omni models init-demo` writes it under (`tiny-<demo>`)."""
    needs: tuple[str, ...] = ()
    """Packages its tiny checkpoint's writer and its stages need beyond the serving set-up's
    (`make serve` installs no torchvision): init-demo skips the family where one is missing."""

    def missing(self) -> list[str]:
        """What of `needs` this Python cannot import."""
        return [m for m in self.needs if not _importable(m)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: its import is blocked
        return False


GENERIC: Final[dict[EngineKind, str]] = {
    EngineKind.SYNTHETIC: "omni_stage.engines.synthetic:SyntheticEngine",
    EngineKind.TRANSFORMERS: "omni_stage.engines.transformers_lm:TransformersEngine",
    EngineKind.TORCH: "omni_stage.engines.torch_module:TorchModuleEngine",
    EngineKind.VLLM: "omni_stage.engines.vllm.engine:VllmEngine",
}
"""The engines of stages that name no part."""

_QWEN = "omni_stage.models.qwen_omni"
_QWEN2_5 = "omni_stage.models.qwen2_5_omni"
_QWEN3 = "omni_stage.models.qwen3_omni"
_QWEN3_TTS = "omni_stage.models.qwen3_tts"
FAMILIES: Final[dict[str, Family]] = {
    "qwen2_5_omni": Family(
        "Qwen2.5-Omni",
        {
            EngineKind.TRANSFORMERS: {
                "encoder": f"{_QWEN}.encoder:Encoder",
                "thinker": f"{_QWEN}.thinker:Thinker",
                "talker": f"{_QWEN2_5}.speech:Talker",
                "token2wav": f"{_QWEN2_5}.speech:Token2Wav",
            },
            EngineKind.VLLM: {"thinker": f"{_QWEN2_5}.vllm_thinker:VllmThinker"},
        },
        checkpoint=f"{_QWEN2_5}.checkpoint:write_tiny_checkpoint",
        demo="qwen2.5-omni",
    ),
    "qwen3_omni_moe": Family(
        "Qwen3-Omni",
        {
            EngineKind.TRANSFORMERS: {
                "encoder": f"{_QWEN3}.thinker:Qwen3Encoder",
                "thinker": f"{_QWEN3}.thinker:Qwen3Thinker",
                "talker": f"{_QWEN3}.speech:Qwen3Talker",
                "code2wav": f"{_QWEN3}.code2wav:Qwen3Code2Wav",
            },
        },
        checkpoint=f"{_QWEN3}.checkpoint:write_tiny_checkpoint",
        demo="qwen3-omni",
    ),
    "qwen3_tts": Family(
        "Qwen3-TTS",
        {
            EngineKind.TRANSFORMERS: {
                "talker": f"{_QWEN3_TTS}.speech:Qwen3TTSTalker",
                "code2wav": f"{_QWEN3_TTS}.speech:Qwen3TTSCode2Wav",
            },
        },
        checkpoint=f"{_QWEN3_TTS}.checkpoint:write_tiny_checkpoint",
        demo="qwen3-tts",
    ),
}
"""Model families by their checkpoints' `model_type`."""
DEFAULT_FAMILY: Final = "qwen2_5_omni"
"""For a checkpoint whose config cannot be read (its part then says what is missing as it loads)."""

_DIFFUSERS = "omni_stage.engines.diffusers"


def _diffusion(
    name: str, package: str, demo: str, engines: tuple[str, str, str], needs: tuple[str, ...] = ()
) -> Family:
    """A diffusion family: its tiny checkpoint's writer (omni_stage.models.<package>.checkpoint),
    its demo's name, and the engines (`module:attribute` under omni_stage.engines.diffusers) of
    its roles: encode, denoise, decode."""
    roles = dict(zip(("encode", "denoise", "decode"), engines, strict=True))
    return Family(
        name,
        {EngineKind.DIFFUSERS: {role: f"{_DIFFUSERS}.{where}" for role, where in roles.items()}},
        checkpoint=f"omni_stage.models.{package}.checkpoint:write_tiny_checkpoint",
        demo=demo,
        needs=needs,
    )


DIFFUSERS_FAMILIES: Final[dict[str, Family]] = {
    "WanTransformer3DModel": _diffusion(
        "Wan 2.1",
        "wan",
        "video",
        ("text:TextEncodeEngine", "video:VideoDenoiseEngine", "video:VideoDecodeEngine"),
    ),
    "QwenImageTransformer2DModel": _diffusion(
        "Qwen-Image-Edit",
        "qwen_image_edit",
        "image-edit",
        ("edit:EditEncodeEngine", "edit:EditDenoiseEngine", "image:DecodeEngine"),
        needs=("torchvision",),  # its Qwen2-VL processor's video part is torchvision's only
    ),
    "PixArtTransformer2DModel": _diffusion(
        "PixArt-Alpha",
        "pixart",
        "image",
        ("text:TextEncodeEngine", "image:DenoiseEngine", "image:DecodeEngine"),
    ),
}
"""Diffusion families by their pipeline directories' denoiser class, the part a stage runs by its
`role`. The demo's last is written last: its index means every demo model is there."""
DEFAULT_DIFFUSERS_FAMILY: Final = "PixArtTransformer2DModel"
"""For any other denoiser (a UNet's: the image stages take one too), or an index that cannot be
read (the stage's loading then says what is wrong with it)."""


def build_engine(stage: StageSpec) -> Engine:
    """The engine of `stage`, as its pipeline file says."""
    kind = stage.engine.kind
    if kind is EngineKind.DIFFUSERS:
        return _diffusers_engine(stage)
    part = stage.engine.args.get("part")
    if part is None:
        if kind not in GENERIC:
            raise EngineError(f"stage '{stage.name}': engine kind '{kind}' is not available in this build")
        return import_object(GENERIC[kind])(stage)
    family = FAMILIES[_model_type(stage) or DEFAULT_FAMILY]
    parts = family.parts.get(kind, {})
    if part not in parts:
        some = ", ".join(parts) or "none"
        raise EngineError(
            f"stage '{stage.name}': engine.args.part must be one of {some} on {family.name} with {kind}"
        )
    return import_object(parts[part])(stage)


def _model_type(stage: StageSpec) -> str | None:
    """The checkpoint's `model_type`, if it is one of FAMILIES'."""
    from transformers import PretrainedConfig

    try:
        model_type = PretrainedConfig.get_config_dict(str(stage.engine.model))[0].get("model_type")
    except OSError:
        return None
    return model_type if model_type in FAMILIES else None


def _diffusers_engine(stage: StageSpec) -> Engine:
    """The engine of the stage's `role`, in the diffusion family its pipeline directory holds."""
    role = stage.engine.args.get("role")
    family = DIFFUSERS_FAMILIES[_denoiser_class(Path(str(stage.engine.model))) or DEFAULT_DIFFUSERS_FAMILY]
    parts = family.parts[EngineKind.DIFFUSERS]
    if role not in parts:
        raise EngineError(
            f"stage '{stage.name}': engine.args.role must be 'encode', 'denoise' or 'decode', got {role!r}"
        )
    return import_object(parts[role])(stage)


def _denoiser_class(path: Path) -> str | None:
    """The pipeline directory's transformer class, if it is one of DIFFUSERS_FAMILIES'."""
    try:
        entry = json.loads((path / "model_index.json").read_text()).get("transformer")
    except (OSError, ValueError, AttributeError):
        return None
    cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    return cls if cls in DIFFUSERS_FAMILIES else None
