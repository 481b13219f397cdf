"""The Qwen3-TTS reference: the `qwen-tts` package's own code on a checkpoint, run in its own
virtualenv (.venv-qwen-tts: it pins transformers 4.57), as its README runs it.

    .venv-qwen-tts/bin/python scripts/qwen_tts_reference.py REQUEST.json OUT_DIR

REQUEST: {"checkpoint": DIR, "custom_voice": [{"text", "speaker", "language", "instruct",
"non_streaming"}], "voice_design": [the same but "speaker"], "voice_clone": [{"text",
"language", "ref_audio": a float32 .npy of samples, "ref_rate", "ref_text", "x_vector_only",
"non_streaming"}], "decode": [[[code x 16] per frame] per item], "timed": {"texts", "speaker",
"rounds"}, "max_new_tokens": N, "codes": true}.
Everything greedy (the talker and its code predictor). OUT_DIR gets result.json: per item of
each task its codes, [frames][16], from `Qwen3TTSForConditionalGeneration.generate` as the
task's own method calls it (none with "codes": false: one generate an item, not two); the
names of checkpoint tensors the reference did not read, or read nothing into. And one float32
.npy a waveform: `<task>_<i>.npy` from `generate_custom_voice` or `generate_voice_design`,
`decode_<i>.npy` from `Qwen3TTSTokenizer.decode`; a voice_clone item's waveform from
`generate_voice_clone`, and what `create_voice_clone_prompt` took from its clip: the x-vector
(`voice_clone_<i>_xvector.npy`) and the clip's codes (result.json's "ref_codes", null without).
With "timed" (`omni bench tts`), result.json's
"timed" holds the seconds of `generate_custom_voice` on the first text alone ("alone_s"), and
on all the texts as one batch ("batch_s"), each `rounds` times, after one warm-up call."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

GREEDY = {"do_sample": False, "subtalker_dosample": False}


def unread(module: torch.nn.Module, weights: Path) -> dict[str, list[str]]:
    """Tensors in `weights` the module has no place for, and places it has that `weights` lacks."""
    with safe_open(str(weights), "pt") as f:
        stored = set(f.keys())
    held = set(module.state_dict())
    return {"unexpected": sorted(stored - held), "missing": sorted(held - stored)}


def codes_of(
    tts: Any, item: dict[str, Any], instruct: str, speaker: str | None, budget: dict[str, Any]
) -> Any:
    """The item's codes, [frames][16], from the model's `generate` as the task's method calls it."""
    ids = tts._tokenize_texts([tts._build_assistant_text(item["text"])])
    instruct_ids = [tts._tokenize_texts([tts._build_instruct_text(instruct)])[0] if instruct else None]
    codes, _ = tts.model.generate(
        input_ids=ids,
        instruct_ids=instruct_ids,
        languages=[item["language"]],
        speakers=[speaker],
        non_streaming_mode=item["non_streaming"],
        **tts._merge_generate_kwargs(**budget),
    )
    return codes[0].tolist()


def clone_codes_of(tts: Any, item: dict[str, Any], prompt: Any, budget: dict[str, Any]) -> Any:
    """A voice_clone item's codes, from `generate` as `generate_voice_clone` calls it."""
    ids = tts._tokenize_texts([tts._build_assistant_text(item["text"])])
    ref_ids = [
        tts._tokenize_texts([tts._build_ref_text(item["ref_text"])])[0] if item.get("ref_text") else None
    ]
    codes, _ = tts.model.generate(
        input_ids=ids,
        ref_ids=ref_ids,
        voice_clone_prompt=tts._prompt_items_to_voice_clone_prompt(prompt),
        languages=[item["language"]],
        non_streaming_mode=item["non_streaming"],
        **tts._merge_generate_kwargs(**budget),
    )
    return codes[0].tolist()


def voice_clone(tts: Any, items: list[dict[str, Any]], out: Path, budget: dict[str, Any], codes: bool) -> Any:
    """Each voice_clone item: its codes (with `codes`), the clip's codes, its waveform and x-vector."""
    result: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        clip = (np.load(item["ref_audio"]), int(item["ref_rate"]))
        prompt = tts.create_voice_clone_prompt(clip, item.get("ref_text"), item["x_vector_only"])
        ref = prompt[0].ref_code
        result.append(
            {
                "codes": clone_codes_of(tts, item, prompt, budget) if codes else None,
                "ref_codes": None if ref is None else ref.tolist(),
            }
        )
        np.save(out / f"voice_clone_{i}_xvector.npy", prompt[0].ref_spk_embedding.float().numpy())
        wavs, _ = tts.generate_voice_clone(
            item["text"],
            language=item["language"],
            voice_clone_prompt=prompt,
            non_streaming_mode=item["non_streaming"],
            **budget,
        )
        np.save(out / f"voice_clone_{i}.npy", np.asarray(wavs[0], dtype=np.float32))
    return result


def timings(
    tts: Any, texts: list[str], speaker: str, rounds: int, budget: dict[str, Any]
) -> dict[str, list[float]]:
    def timed(text: str | list[str]) -> float:
        t0 = time.perf_counter()
        tts.generate_custom_voice(text, speaker=speaker, language="Auto", **budget)
        return time.perf_counter() - t0

    timed(texts[0])  # warm-up
    alone = [timed(text) for _ in range(rounds) for text in texts[:1]]
    return {"alone_s": alone, "batch_s": [timed(texts) for _ in range(rounds)]}


def main(request_file: str, out_dir: str) -> None:
    from qwen_tts import Qwen3TTSModel

    request: dict[str, Any] = json.loads(Path(request_file).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(request["checkpoint"])
    tts = Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32)
    result: dict[str, Any] = {
        "model": unread(tts.model, ckpt / "model.safetensors"),
        "speech_tokenizer": unread(
            tts.model.speech_tokenizer.model, ckpt / "speech_tokenizer" / "model.safetensors"
        ),
    }
    budget = {"max_new_tokens": request.get("max_new_tokens", 64), **GREEDY}
    for task, speak in (
        ("custom_voice", tts.generate_custom_voice),
        ("voice_design", tts.generate_voice_design),
    ):
        result[task] = []
        for i, item in enumerate(request.get(task, [])):
            instruct = item.get("instruct") or ""
            speaker = {"speaker": item["speaker"]} if task == "custom_voice" else {}
            if request.get("codes", True):
                result[task].append(codes_of(tts, item, instruct, speaker.get("speaker"), budget))
            wavs, rate = speak(
                item["text"],
                language=item["language"],
                instruct=instruct or None,
                non_streaming_mode=item["non_streaming"],
                **speaker,
                **budget,
            )
            np.save(out / f"{task}_{i}.npy", np.asarray(wavs[0], dtype=np.float32))
            result["sample_rate"] = int(rate)
    result["voice_clone"] = voice_clone(
        tts, request.get("voice_clone", []), out, budget, request.get("codes", True)
    )
    if timed := request.get("timed"):
        result["timed"] = timings(tts, timed["texts"], timed["speaker"], int(timed["rounds"]), budget)
    for i, codes in enumerate(request.get("decode", [])):
        wavs, rate = tts.model.speech_tokenizer.decode([{"audio_codes": torch.tensor(codes)}])
        np.save(out / f"decode_{i}.npy", np.asarray(wavs[0], dtype=np.float32))
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
