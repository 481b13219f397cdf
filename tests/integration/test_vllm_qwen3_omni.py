"""tiny-qwen3-omni's thinker on vLLM's real CPU build (the plain vLLM engine, text in and out):
vLLM loads the checkpoint as the real Qwen3-Omni's (its Qwen3OmniMoeThinkerForConditionalGeneration)
and answers greedily with the tokens of the transformers thinker stage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omni_pipeline.sampling import Sampling
from omni_pipeline.spec import EngineSpec, load_pipeline
from omni_stage.engines.base import EngineCall
from omni_stage.engines.registry import build_engine
from omni_stage.engines.vllm.engine import VllmEngine
from tests.helpers import ROOT, VLLM_TIMEOUT_S
from tests.integration.test_vllm import LoopThread, collect, token_ids

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT_S)

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def test_vllm_loads_the_thinker_and_answers_as_the_transformers_thinker(demo_dir: Path) -> None:
    model = demo_dir / "models" / "tiny-qwen3-omni"
    spec = load_pipeline(ROOT / "examples" / "qwen3-omni.yaml").spec.stage("thinker")
    args = {
        "max_model_len": 1024,
        "dtype": "float32",
        "limit_mm_per_prompt": {"image": 0, "audio": 0, "video": 0},
    }
    vllm = build_engine(
        spec.model_copy(update={"engine": EngineSpec(kind="vllm", model=str(model), args=args)})
    )
    assert isinstance(vllm, VllmEngine)
    sampling = {"max_tokens": 12, "temperature": 0}
    call = {"request": {"messages": MESSAGES, "media": {}}}
    loop = LoopThread()
    try:
        loop.run(vllm.start(), timeout=300)
        ours = loop.run(collect(vllm, EngineCall("v", call, True, Sampling.of(sampling))))
        loop.run(vllm.close())
    finally:
        loop.stop()
    hf = build_engine(
        spec.model_copy(update={"engine": spec.engine.model_copy(update={"model": str(model)})})
    )

    async def reference() -> list[int]:
        await hf.start()
        return token_ids(await collect(hf, EngineCall("t", call, True, Sampling.of(sampling))))

    assert token_ids(ours) == asyncio.run(reference())
    assert len(token_ids(ours)) == 12
