"""What a stage process imports before it serves, named for `omni serve`'s fork server, which
imports it once so that every stage forked from it (and every restart) starts with it imported.

Transformers' auto classes (and with them generation, Dynamo and torch.distributed) cost about
2.4 s of CPU to import, in every stage that loads a model through them: three times over in a
Qwen2.5-Omni pipeline. Only what a pipeline's engine kinds use is named, so a pipeline without
such a stage does not pay for it; vLLM is never named (it starts processes and threads of its
own, which a fork server must not hold).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from omni_pipeline.spec import EngineKind

EVERY_STAGE: Final = ("omni_stage.proc",)
"""The stage worker itself (torch among it)."""
_TRANSFORMERS: Final = ("transformers.models.auto.modeling_auto", "transformers.models.auto.processing_auto")
BY_KIND: Final[dict[EngineKind, tuple[str, ...]]] = {
    EngineKind.TRANSFORMERS: _TRANSFORMERS,
    EngineKind.DIFFUSERS: (*_TRANSFORMERS, "diffusers"),  # its text encoders are transformers models
}
"""What a stage of each engine kind imports when it loads its engine."""


def stage_modules(kinds: Iterable[EngineKind]) -> list[str]:
    """What stages of these engine kinds import, each module once."""
    return list(dict.fromkeys([*EVERY_STAGE, *(m for k in kinds for m in BY_KIND.get(k, ()))]))
