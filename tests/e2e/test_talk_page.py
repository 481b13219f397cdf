"""The talk page (`GET /talk`) in a real browser: Debian's headless Chromium, driven by selenium
through Debian's chromium-driver, its microphone a WAV file (Chromium's fake capture device),
against `omni serve` of Qwen2.5-Omni (the tiny checkpoint), which hears."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import yaml

from tests.helpers import ROOT, served, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/qwen2.5-omni.yaml, its thinker writing 1000 tokens at least (vLLM's `min_tokens`):
    an answer of the tiny checkpoint is still being made when the looped speech comes back."""
    example = yaml.safe_load((ROOT / "examples" / "qwen2.5-omni.yaml").read_text())
    example["spec"]["stages"][0]["sampling"] = {"max_tokens": 2000, "min_tokens": 1000}
    pipeline = demo_dir / "qwen2.5-omni-talk.yaml"
    pipeline.write_text(yaml.safe_dump(example))
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, url):
        yield url


def test_the_talk_page_in_a_browser(base: str, tmp_path: Path) -> None:
    """The microphone is espeak-ng's speech and 1.5 s of silence, looped: the page streams it,
    server VAD ends the turn, the answer's transcript shows and its audio plays; the speech
    coming round again cuts the answer off (barge-in: `turn_detected`), and is the next turn."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    speech = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(speech), "Hello, how are you doing today?"], check=True)
    samples, rate = soundfile.read(speech, dtype="float32")
    mic = tmp_path / "mic.wav"
    soundfile.write(
        mic, np.concatenate([samples, np.zeros(int(rate * 1.5), np.float32)]), rate, subtype="PCM_16"
    )
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic}",
        "--autoplay-policy=no-user-gesture-required",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        browser.get(f"{base}/talk")
        browser.find_element(By.ID, "talk").click()

        def page() -> dict[str, Any]:
            return browser.execute_script("return window.omniTalk")

        wait_for(lambda: page()["transcript"] and page()["heardSamples"] > 0, 120, "an answer heard")
        wait_for(lambda: "turn_detected" in page()["cancelled"], 120, "speech to cut an answer off")
        wait_for(lambda: page()["turns"] >= 2, 60, "the speech that cut it off to be the next turn")
        # In one script, so that no delta lands between the two: every answer's transcript, as
        # the page keeps it and as its log shows it, one line an answer (an answer cut off
        # early is a few characters: the transcript runs across answers, the log does not).
        answers = "Array.from(document.querySelectorAll('#log p.model'), p => p.textContent)"
        state, shown = browser.execute_script(f"return [window.omniTalk, {answers}]")
        assert state["errors"] == [], state
        assert shown and "".join(shown) == state["transcript"], (shown, state["transcript"])
    finally:
        browser.quit()
