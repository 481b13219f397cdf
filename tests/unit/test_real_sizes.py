"""The real models' shapes without their weights: config-only checkpoints at Qwen3-Omni-30B-A3B's,
Qwen2.5-Omni-7B's and Qwen3-TTS-12Hz's sizes (what a GPU run serves where the weights cannot be
fetched or do not fit the disk), and `loadFormat: dummy`, which builds a part at its config's
sizes with random weights on the device (vLLM's `load_format: dummy`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from bench.in_process import stage_engine
from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import EngineCall, EngineError
from omni_stage.models.qwen2_5_omni import checkpoint as qwen2_5_omni
from omni_stage.models.qwen3_omni import checkpoint as qwen3_omni
from omni_stage.models.qwen3_tts import checkpoint as qwen3_tts
from omni_stage.models.qwen_omni.parts import DUMMY_RANGE
from omni_stage.payload import concat
from tests.helpers import OMNI, ROOT, weights_readable_as_their_configs


def _on_meta(config: Any, cls: Any) -> dict[str, float]:
    """Billions of parameters of each part, the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = cls(config)
    return {name: sum(p.numel() for p in part.parameters()) / 1e9 for name, part in model.named_children()}


def test_qwen3_omni_config_only_is_30b_a3b(tmp_path: Path) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    path = qwen3_omni.write_config_only(tmp_path)
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()
    c = Qwen3OmniMoeConfig.from_pretrained(path)
    text, talker = c.thinker_config.text_config, c.talker_config
    assert (text.num_hidden_layers, text.num_experts, text.num_experts_per_tok, text.vocab_size) == (
        48,
        128,
        8,
        152064,
    )
    assert (talker.num_code_groups, talker.accept_hidden_layer, talker.text_config.num_hidden_layers) == (
        16,
        24,
        20,
    )
    sizes = _on_meta(c, Qwen3OmniMoeForConditionalGeneration)
    assert 31.5 < sizes["thinker"] < 32 and 3.2 < sizes["talker"] < 3.4 and 0.2 < sizes["code2wav"] < 0.25


def test_qwen2_5_omni_config_only_is_7b(tmp_path: Path) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    path = qwen2_5_omni.write_config_only(tmp_path)
    voices = torch.load(path / "spk_dict.pt", weights_only=True)
    assert {v: s["cond"].shape for v, s in voices.items()} == {"Chelsie": (1, 192), "Ethan": (1, 192)}
    c = Qwen2_5OmniConfig.from_pretrained(path)
    assert (c.thinker_config.text_config.hidden_size, c.talker_config.num_hidden_layers) == (3584, 24)
    sizes = _on_meta(c, Qwen2_5OmniForConditionalGeneration)
    assert 8.8 < sizes["thinker"] < 9.1 and 1.3 < sizes["talker"] < 1.4 and 0.4 < sizes["token2wav"] < 0.5


@pytest.mark.parametrize(
    ("release", "model_gb"), [("qwen3-tts-0.6b-base", 1.83), ("qwen3-tts-1.7b-base", 3.86)]
)
def test_qwen3_tts_config_only_weighs_what_the_released_files_weigh(
    tmp_path: Path, release: str, model_gb: float
) -> None:
    """Built on the meta device from the config-only checkpoint: model.safetensors' tensors (the
    talker with its code predictor, the speaker encoder) in bf16, and the speech tokenizer's
    (its decoder, Mimi's encoder with its codebooks) in float32, weigh what the released
    files do: 1.83 GB for Qwen3-TTS-12Hz-0.6B-Base, 682 MB for the speech tokenizer (as its
    ports publish them); the 1.7B's talker is Qwen3-1.7B's decoder as the 0.6B's is
    Qwen3-0.6B's, 3.86 GB (checkpoint.py)."""
    from transformers import MimiConfig

    from omni_stage.models.qwen3_tts.cloning import SpeakerEncoder, SpeechEncoder
    from omni_stage.models.qwen3_tts.loading import read_config
    from omni_stage.models.qwen3_tts.modeling import SpeechDecoder, Talker

    path = qwen3_tts.write_config_only(tmp_path, release)
    assert not list(path.rglob("*.safetensors"))
    settings = read_config(path)
    tokenizer = json.loads((path / "speech_tokenizer" / "config.json").read_text())
    mimi = {k: v for k, v in tokenizer["encoder_config"].items() if k != "model_type"}
    with torch.device("meta"):
        model = [Talker(settings["talker_config"]), SpeakerEncoder(settings["speaker_encoder_config"])]
        codec = [SpeechDecoder(tokenizer["decoder_config"]), SpeechEncoder(MimiConfig(**mimi))]

    def gb(modules: list[torch.nn.Module], width: int) -> float:
        tensors = [t for m in modules for t in m.state_dict().values()]  # what a checkpoint holds
        return sum(t.numel() for t in tensors if t.is_floating_point()) * width / 1e9

    assert gb(model, 2) == pytest.approx(model_gb, abs=0.02)
    assert gb(codec, 4) == pytest.approx(0.682, abs=0.01)
    assert settings["talker_config"]["text_vocab_size"] == 151936


def test_qwen3_tts_dummy_weights_speak(tmp_path: Path) -> None:
    """A config-only Qwen3-TTS checkpoint (at the demo's sizes) served with `loadFormat: dummy`:
    every weight drawn from +-DUMMY_RANGE, the talker speaks and the decoder voices it; a Base
    model's talker builds what clones a voice the same way."""
    example = ROOT / "examples" / "qwen3-tts.yaml"

    async def go(model: Path, base: Path) -> tuple[list[torch.Tensor], int, int]:
        talker, code2wav, cloning = (
            stage_engine(example, stage, path, 1, loadFormat="dummy")
            for stage, path in (("talker", model), ("code2wav", model), ("talker", base))
        )
        for e in (talker, code2wav, cloning):
            await e.start()
        call = EngineCall("r", {"request": {"prompt": "The sea is calm."}}, True, Sampling(max_tokens=4))
        frames = concat([o.data async for o in talker.generate(call)])
        call = EngineCall("r", {"talker": frames}, True, Sampling())
        audio = [o.data["audio"] async for o in code2wav.generate(call)]
        parts = (talker.model, code2wav.model, cloning.cloner.speaker, cloning.cloner.speech)  # type: ignore[attr-defined]
        weights = [p.detach() for m in parts for p in m.parameters() if p.is_floating_point()]
        for e in (talker, code2wav, cloning):
            await e.close()
        return weights, int(frames["codes"].shape[0]), int(torch.cat(audio).numel())

    tiny = qwen3_tts.TINY
    model = qwen3_tts.write_config_only(tmp_path / "voice", "qwen3-tts-0.6b-customvoice", tiny)
    base = qwen3_tts.write_config_only(tmp_path / "base", "qwen3-tts-0.6b-base", tiny)
    weights, frames, samples = asyncio.run(go(model, base))
    assert all(float(w.abs().max()) <= DUMMY_RANGE for w in weights)
    assert frames > 0 and samples == frames * 1920


def _tiny(family: ModuleType, path: Path) -> Path:
    """A config-only checkpoint at the demo's sizes, with the real vocabulary (152064 ids: a reply
    then holds ids past the demo tokenizer's)."""
    return family.write_config_only(path, dataclasses.replace(family.TINY, thinker_vocab=152064))


@pytest.mark.parametrize(
    ("family", "example"),
    [(qwen3_omni, "qwen3-omni.yaml"), (qwen2_5_omni, "qwen2.5-omni.yaml")],
    ids=["qwen3-omni", "qwen2.5-omni"],
)
def test_dummy_weights_are_small_seeded_and_speak(family: ModuleType, example: str, tmp_path: Path) -> None:
    """Every weight drawn from +-DUMMY_RANGE, the same at every load (two replicas compute the
    same); the thinker writes the tokens asked (min_tokens: none ends it early) and the talker
    speaks them."""
    model = _tiny(family, tmp_path)

    async def go() -> tuple[list[torch.Tensor], list[int], Any]:
        thinker, talker, again = (
            stage_engine(ROOT / "examples" / example, name, model, 1, loadFormat="dummy")
            for name in ("thinker", "talker", "talker")
        )
        for e in (thinker, talker, again):
            await e.start()
        request = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "media": {}}
        sampling = Sampling(max_tokens=6, min_tokens=6)
        thought = [o async for o in thinker.generate(EngineCall("r", {"request": request}, True, sampling))]
        reply = concat([o.data for o in thought if o.data])
        call = EngineCall("r", {"thinker": reply}, True, Sampling(max_tokens=8))
        codes = concat([o.data async for o in talker.generate(call)])["codes"]
        weights = [p.detach() for p in talker.model.parameters() if p.is_floating_point()]  # type: ignore[attr-defined]
        same = all(torch.equal(a, b) for a, b in zip(weights, again.model.parameters(), strict=True))  # type: ignore[attr-defined]
        return weights, [o.units for o in thought], (codes, same)

    weights, units, (codes, same) = asyncio.run(go())
    assert all(float(w.abs().max()) <= DUMMY_RANGE for w in weights) and same
    assert sum(units) == 6 and codes.shape[0] > 0


def _weights(*modules: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for m in modules for k, v in m.state_dict().items()]


def _same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True)
    )


def _read_as_dummy_builds(example: Path, model: Path, stages: dict[str, Any]) -> list[bool]:
    """For each stage of `example` (`stages`: its name, and what of its engine holds weights),
    whether the engine reading `model` (`loadFormat: auto`) holds what the one building them
    (`dummy`) holds, every tensor."""

    async def go() -> list[bool]:
        same = []
        for name, modules in stages.items():
            built = [stage_engine(example, name, model, 1, loadFormat=f) for f in ("auto", "dummy")]
            try:
                for e in built:
                    await e.start()
                same.append(_same(*(_weights(*modules(e)) for e in built)))
            finally:
                for e in built:
                    await e.close()
        return same

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("family", "example"),
    [(qwen3_omni, "qwen3-omni.yaml"), (qwen2_5_omni, "qwen2.5-omni.yaml")],
    ids=["qwen3-omni", "qwen2.5-omni"],
)
def test_random_weights_written_are_what_dummy_builds(
    family: ModuleType, example: str, tmp_path: Path
) -> None:
    """`omni models init-random`'s checkpoint (at the demo's sizes here: the real ones take tens
    of GB, never in CI) is laid out as the released one, safetensors shards and their index
    (Qwen3-Omni's experts each apart, as its files have them); each stage reads from it through
    the real loading code (`loadFormat: auto`) the very weights `loadFormat: dummy` builds. (A
    talker's TTS rows of the thinker's table are the one thing dummy draws apart.)"""
    sizes = dataclasses.replace(family.TINY, thinker_vocab=152064)
    model = family.write_random(tmp_path / "q", dtype=torch.float32, shard="4MB", sizes=sizes)
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and all((model / f).exists() for f in index.values())
    assert (family is qwen2_5_omni) or "talker.model.layers.0.mlp.experts.0.up_proj.weight" in index
    assert weights_readable_as_their_configs(model)

    parts = dict.fromkeys(("thinker", "talker", "code2wav"), lambda e: [e.model])
    assert _read_as_dummy_builds(ROOT / "examples" / example, model, parts) == [True, True, True]


def test_qwen3_tts_random_weights_written_are_what_dummy_builds(tmp_path: Path) -> None:
    """The same for a Qwen3-TTS Base release: model.safetensors and speech_tokenizer/'s, each
    stage's modules (the talker, the decoder, and what clones a voice) read as dummy builds them."""
    model = qwen3_tts.write_random(
        tmp_path / "q", "qwen3-tts-0.6b-base", dtype=torch.float32, sizes=qwen3_tts.TINY
    )
    assert (model / "model.safetensors").exists() and (
        model / "speech_tokenizer" / "model.safetensors"
    ).exists()
    assert weights_readable_as_their_configs(model)
    parts = {
        "talker": lambda e: [e.model, e.cloner.speaker, e.cloner.speech],
        "code2wav": lambda e: [e.model],
    }
    assert _read_as_dummy_builds(ROOT / "examples" / "qwen3-tts.yaml", model, parts) == [True, True]


def test_an_unknown_load_format_is_refused_by_name(tmp_path: Path) -> None:
    model = _tiny(qwen3_omni, tmp_path)
    with pytest.raises(EngineError, match=r"loadFormat must be one of auto, dummy; got 'random'"):
        stage_engine(ROOT / "examples" / "qwen3-omni.yaml", "talker", model, 1, loadFormat="random")


@pytest.mark.parametrize(
    ("model", "files"),
    [("qwen2.5-omni", ["spk_dict.pt"]), ("qwen3-tts-1.7b-voicedesign", ["speech_tokenizer/config.json"])],
)
def test_omni_models_writes_a_config_only_checkpoint(
    tmp_path: Path, model: str, files: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The command as its parser reads it, in this process (which has imported the writers);
    the command itself is run below."""
    from omni_cli.main import parser

    a = parser().parse_args(["models", "init-config-only", model, str(tmp_path / "q")])
    assert a.fn(a) == 0
    assert "loadFormat: dummy" in capsys.readouterr().out
    assert all((tmp_path / "q" / f).exists() for f in ["config.json", *files])


@pytest.mark.parametrize("command", ["init-config-only", "init-random"])
def test_omni_models_names_the_models_it_knows(tmp_path: Path, command: str) -> None:
    """At once: the name is checked before the writers load torch and transformers."""
    out = subprocess.run(
        [*OMNI, "models", command, "qwen3-tts-7b", str(tmp_path / "q")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and not (tmp_path / "q").exists()
    assert (
        "unknown model 'qwen3-tts-7b': one of qwen3-omni, qwen2.5-omni, qwen3-tts-1.7b-customvoice"
        in out.stderr
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_init_random_on_a_device_that_is_not_there_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before anything is written, and naming the option (not a traceback from deep in torch).
    The command as its parser reads it (main's logging set-up left out of the tests' process)."""
    from omni_cli.main import parser

    a = parser().parse_args(
        ["models", "init-random", "qwen3-tts-0.6b-base", str(tmp_path / "q"), "--device", "cuda"]
    )
    assert a.fn(a) == 2
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
