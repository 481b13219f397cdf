"""The talk page (`GET /talk`) in a real browser: Debian's headless Chromium, driven by selenium
through Debian's chromium-driver, its microphone a WAV file (Chromium's fake capture device),
against `omni serve` of Qwen2.5-Omni (the tiny checkpoint), which hears, and of the toy demo,
which does not."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import yaml

from tests.helpers import ROOT, served, served_example, wait_for

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


@pytest.fixture(scope="module")
def mic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """espeak-ng's speech and 4 s of silence: Chromium loops it as its fake microphone."""
    where = tmp_path_factory.mktemp("mic")
    speech = where / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(speech), "Hello, how are you doing today?"], check=True)
    samples, rate = soundfile.read(speech, dtype="float32")
    looped = where / "mic.wav"
    soundfile.write(
        looped, np.concatenate([samples, np.zeros(int(rate * 4), np.float32)]), rate, subtype="PCM_16"
    )
    return looped


@contextlib.contextmanager
def chromium(mic: Path) -> Iterator[Any]:
    """Headless Chromium whose microphone is `mic` and which plays audio unasked."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

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
        yield browser
    finally:
        browser.quit()


def waiter(browser: Any) -> tuple[Callable[[], dict[str, Any]], Callable[..., None]]:
    """The page's state (window.omniTalk), and a wait on it that says, on a timeout, what the
    page had (less its events)."""

    def page() -> dict[str, Any]:
        return browser.execute_script("return window.omniTalk")  # type: ignore[no-any-return]

    def until(cond: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> None:
        try:
            wait_for(lambda: cond(page()), timeout, what)
        except AssertionError as exc:
            state = page()
            raise AssertionError(f"{exc}; the page: {dict(state, events=len(state['events']))}") from None

    return page, until


def test_the_talk_page_in_a_browser(base: str, mic: Path) -> None:
    """The microphone is espeak-ng's speech and 4 s of silence, looped: the page streams it (its
    level meter moving), server VAD ends the turn, the answer's transcript shows and its audio
    plays in the voice picked from the model's list, with its first audio's time after the end
    of the turn shown; the speech coming round again cuts the answer off (barge-in:
    `turn_detected`), and is the next turn. Then, on the page opened again, a typed message is
    answered the same way, the microphone never asked for.

    The silence is what the answer has to be heard in: 3.5 s after VAD's 500 ms. Here its first
    audio comes 0.4 s after the turn ends and the tiny talker's whole audio is 0.48 s; with 1.5 s
    of silence that left 0.3 s to spare, and a loaded CI machine missed it on every turn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with chromium(mic) as browser:
        page, until = waiter(browser)
        browser.get(f"{base}/talk")
        until(lambda p: p["voices"] == ["Chelsie", "Ethan"], 60, "the model's voices listed")
        Select(browser.find_element(By.ID, "voice")).select_by_value("Ethan")  # not the default
        browser.find_element(By.ID, "talk").click()
        until(lambda p: bool(p["transcript"]) and p["heardSamples"] > 0, 120, "an answer heard")
        until(lambda p: "turn_detected" in p["cancelled"], 120, "speech to cut an answer off")
        until(lambda p: p["turns"] >= 2, 60, "the speech that cut it off to be the next turn")
        # In one script, so that no event lands between them (the microphone loops: answers keep
        # coming): every answer's transcript, as the page keeps it and as its log shows it, one
        # line an answer (an answer cut off early is a few characters: the transcript runs
        # across answers, the log does not), and the log's first-audio times.
        answers = "Array.from(document.querySelectorAll('#log p.model'), p => p.textContent)"
        timed = "Array.from(document.querySelectorAll('#log p.timing'), p => p.textContent)"
        state, shown, timings = browser.execute_script(f"return [window.omniTalk, {answers}, {timed}]")
        assert state["errors"] == [], state
        assert shown and "".join(shown) == state["transcript"], (shown, state["transcript"])
        assert state["peakLevel"] > 0.1, state["peakLevel"]  # the meter saw the speech
        assert state["answerVoices"] and set(state["answerVoices"]) == {"Ethan"}, state["answerVoices"]
        assert state["firstAudioMs"] and len(timings) == len(state["firstAudioMs"])
        assert all(ms > 0 for ms in state["firstAudioMs"])
        assert f"first audio {state['firstAudioMs'][0]} ms" in timings[0]

        browser.get(f"{base}/talk")  # typed: no microphone, so no speech comes round to cut it off
        browser.find_element(By.ID, "text").send_keys("Hello there, what can you do?")
        browser.find_element(By.ID, "send").click()
        until(lambda p: bool(p["transcript"]) and p["heardSamples"] > 0, 120, "a typed message answered")
        state = page()
        assert state["typed"] == 1 and state["turns"] == 0 and state["errors"] == [], state
        assert len(state["firstAudioMs"]) == 1 and state["answerVoices"] == [None], state


def test_a_pipeline_that_does_not_hear_says_which_to_serve(demo_dir: Path, mic: Path, tmp_path: Path) -> None:
    """The toy demo (examples/tiny-omni.yaml) reads text only: the first spoken turn's error
    shows the page's note naming the pipeline that hears, the microphone stops, and a typed line
    is answered with audio in a session of its own (the first one holds the spoken turn)."""
    from selenium.webdriver.common.by import By

    with (
        served_example("tiny-omni.yaml", demo_dir, tmp_path) as url,
        chromium(mic) as browser,
    ):
        page, until = waiter(browser)
        browser.get(f"{url}/talk")
        browser.find_element(By.ID, "talk").click()
        hint = browser.find_element(By.ID, "hint")
        wait_for(hint.is_displayed, 60, "the note that this pipeline does not hear")
        assert "examples/qwen2.5-omni.yaml" in hint.text and "make serve" in hint.text
        assert not browser.find_element(By.ID, "talk").is_enabled()
        browser.find_element(By.ID, "text").send_keys("Hello")
        browser.find_element(By.ID, "send").click()
        until(lambda p: bool(p["transcript"]) and p["heardSamples"] > 0, 60, "the typed line answered")
        assert all("input_audio" in e for e in page()["errors"])
