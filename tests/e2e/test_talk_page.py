"""The talk page (`GET /talk`) in a real browser: Debian's headless Chromium, driven by selenium
through Debian's chromium-driver, its microphone a WAV file (Chromium's fake capture device),
against `omni serve` of Qwen2.5-Omni (the tiny checkpoint), which hears."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
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
    """examples/qwen2.5-omni.yaml, its thinker writing 4000 tokens (vLLM's `min_tokens`): an
    answer of the tiny checkpoint is still being made when the looped speech comes back (here
    its thinker writes ~280 a second), and a cut-off answer and the next still fit the
    checkpoint's context of 8192."""
    example = yaml.safe_load((ROOT / "examples" / "qwen2.5-omni.yaml").read_text())
    example["spec"]["stages"][0]["sampling"] = {"max_tokens": 4000, "min_tokens": 4000}
    pipeline = demo_dir / "qwen2.5-omni-talk.yaml"
    pipeline.write_text(yaml.safe_dump(example))
    with served(pipeline, demo_dir, tmp_path_factory.mktemp("logs") / "serve.log") as (_, url):
        yield url


def test_the_talk_page_in_a_browser(base: str, tmp_path: Path) -> None:
    """The microphone is espeak-ng's speech and 4 s of silence, looped: the page streams it,
    server VAD ends the turn, the answer's transcript shows and its audio plays; the speech
    coming round again cuts the answer off (barge-in: `turn_detected`), and is the next turn.

    The silence is what the answer has to be heard in: 3.5 s after VAD's 500 ms. Here its first
    audio comes 0.4 s after the turn ends and the tiny talker's whole audio is 0.48 s; with 1.5 s
    of silence that left 0.3 s to spare, and a loaded CI machine missed it on every turn."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    speech = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(speech), "Hello, how are you doing today?"], check=True)
    samples, rate = soundfile.read(speech, dtype="float32")
    mic = tmp_path / "mic.wav"
    soundfile.write(
        mic, np.concatenate([samples, np.zeros(int(rate * 4), np.float32)]), rate, subtype="PCM_16"
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

        def until(cond: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> None:
            """wait_for on the page's state; a timeout says what the page had (less its events)."""
            try:
                wait_for(lambda: cond(page()), timeout, what)
            except AssertionError as exc:
                state = page()
                raise AssertionError(f"{exc}; the page: {dict(state, events=len(state['events']))}") from None

        until(lambda p: bool(p["transcript"]) and p["heardSamples"] > 0, 120, "an answer heard")
        until(lambda p: "turn_detected" in p["cancelled"], 120, "speech to cut an answer off")
        until(lambda p: p["turns"] >= 2, 60, "the speech that cut it off to be the next turn")
        # In one script, so that no delta lands between the two: every answer's transcript, as
        # the page keeps it and as its log shows it, one line an answer (an answer cut off
        # early is a few characters: the transcript runs across answers, the log does not).
        answers = "Array.from(document.querySelectorAll('#log p.model'), p => p.textContent)"
        state, shown = browser.execute_script(f"return [window.omniTalk, {answers}]")
        assert state["errors"] == [], state
        assert shown and "".join(shown) == state["transcript"], (shown, state["transcript"])
    finally:
        browser.quit()
