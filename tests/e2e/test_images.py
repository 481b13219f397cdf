"""Image generation end to end: `omni serve examples/tiny-image.yaml` (a text encoder, a PixArt
diffusion transformer, a VAE: random weights, real diffusers loading and sampling) and the
official openai client."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from tests.deployment import gauges, metric_values, metrics_urls, settle
from tests.helpers import HTTP, openai_client, served_example, sse_data, wait_for
from tests.openai_schema import violations

pytestmark = pytest.mark.slow

STEPS = "omni_engine_steps_total"


@pytest.fixture(scope="module")
def image_demo(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_example("tiny-image.yaml", demo_dir, tmp_path_factory.mktemp("logs")) as base:
        yield base


def decode(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


@pytest.mark.parametrize(
    ("output_format", "pil_format"), [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")]
)
def test_images_decode_to_the_requested_size(image_demo: str, output_format: str, pil_format: str) -> None:
    r = openai_client(image_demo).images.generate(
        model="tiny-image",
        prompt="a lighthouse at dusk",
        n=2,
        size="64x48",
        output_format=output_format,  # type: ignore[arg-type]
        extra_body={"num_inference_steps": 6, "seed": 7},
    )
    assert r.data is not None and len(r.data) == 2 and r.size == "64x48" and r.output_format == output_format
    images = [decode(d.b64_json or "") for d in r.data]
    assert all(img.format == pil_format and img.size == (64, 48) and img.mode == "RGB" for img in images)
    if output_format == "png":  # lossless: the two images of one request differ (their own noise)
        assert np.asarray(images[0]).tobytes() != np.asarray(images[1]).tobytes()


def generate(base: str, **body: object) -> tuple[str, str]:
    """One request's first image (base64) and its X-Request-Id."""
    raw = openai_client(base).images.with_raw_response.generate(
        model="tiny-image", prompt="a red fox", size="32x32", extra_body={"num_inference_steps": 4, **body}
    )
    r = raw.parse()
    assert r.data is not None
    return r.data[0].b64_json or "", raw.headers["x-request-id"]


def test_requests_at_the_same_moment_stay_apart(image_demo: str) -> None:
    """Eight identical requests at once: each its own id, each the image its seed makes alone.

    They run in batches (one denoiser forward for the steps of several requests), where float
    sums go in another order than alone: a pixel may round the other way, by 1 (the engine
    tests bound the latents; `maxBatch: 1` is bit for bit). A request that saw another's
    latents or prompt would be a different image altogether, as another seed's is."""
    alone = pixels(generate(image_demo, seed=11)[0])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: generate(image_demo, seed=11), range(8)))
    assert len({rid for _, rid in results}) == 8
    for img, _ in results:
        assert np.abs(pixels(img) - alone).max() <= 1
    assert np.abs(pixels(generate(image_demo, seed=12)[0]) - alone).mean() > 8


def pixels(b64: str) -> np.ndarray:
    return np.asarray(decode(b64), dtype=np.int16)


def test_guidance_and_negative_prompt_steer_the_image(image_demo: str) -> None:
    plain = generate(image_demo, seed=5, guidance_scale=4.5)[0]
    assert generate(image_demo, seed=5, guidance_scale=4.5, negative_prompt="blurry")[0] != plain
    assert generate(image_demo, seed=5, guidance_scale=1.0)[0] != plain
    assert generate(image_demo, seed=5, guidance_scale=4.5)[0] == plain


def stream_events(base: str, **body: object) -> list[tuple[str, Image.Image]]:
    stream = openai_client(base).images.generate(
        model="tiny-image", prompt="a city of glass", size="64x32", stream=True, extra_body=body
    )
    return [(ev.type, decode(ev.b64_json)) for ev in stream]


def test_stream_sends_previews_then_the_image(image_demo: str) -> None:
    events = stream_events(image_demo, num_inference_steps=12)  # a preview every 4 steps
    kinds = [k for k, _ in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert all(img.size == (64, 32) for _, img in events)  # previews too come at the full size
    assert [k for k, _ in stream_events(image_demo, num_inference_steps=12, partial_images=1)] == [
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert [k for k, _ in stream_events(image_demo, num_inference_steps=12, partial_images=0)] == [
        "image_generation.completed"
    ]


def test_abort_mid_diffusion_stops_the_loop_and_frees(image_demo: str) -> None:
    """The client leaves after the first preview of 1000 steps. Then: the denoiser holds no
    request and no process holds anything for it. A one-step request after it completes with
    the step count still far below 1000: the loop did not go on in the compute thread (a
    replica's steps run on one thread, so that request would have waited behind it)."""
    dit = metrics_urls([image_demo])["dit-0"]
    generate(image_demo, num_inference_steps=1)  # nats-py makes its reply subscription on first use
    idle = gauges([image_demo])
    before = metric_values(dit, (STEPS,))[STEPS]
    stream = openai_client(image_demo).images.generate(
        model="tiny-image",
        prompt="a long walk",
        size="64x64",
        stream=True,
        extra_body={"num_inference_steps": 1000},
    )
    first = next(iter(stream))
    assert first.type == "image_generation.partial_image"
    stream.close()  # the client goes away mid-diffusion
    wait_for(
        lambda: metric_values(dit, ("omni_engine_active_requests",))["omni_engine_active_requests"] == 0,
        30,
        "the denoiser to drop the request",
    )
    settle([image_demo], idle)
    generate(image_demo, num_inference_steps=1)
    ran = metric_values(dit, (STEPS,))[STEPS] - before
    print(f"steps ran: {ran}")
    assert 4 <= ran < 1000 - 100, f"{ran} steps ran"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"size": "65x64"}, None, "multiples of 8"),
        ({"size": "512x512"}, None, "from 8 to 256"),
        ({"response_format": "url"}, "response_format", "use b64_json"),
        ({"n": 11}, "n", "less than or equal to 10"),
        ({"num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
        ({"size": "big"}, "size", "pattern"),
        ({"quality": "hd"}, "quality", "not served by this server"),
        ({"style": "vivid"}, "style", "not served by this server"),
        ({"background": "transparent"}, "background", "not served by this server"),
    ],
    ids=[
        "not-a-multiple",
        "too-big-for-the-model",
        "url",
        "too-many",
        "no-steps",
        "bad-size",
        "hd",
        "vivid",
        "transparent",
    ],
)
def test_what_the_model_cannot_do_is_a_400(
    image_demo: str, body: dict[str, object], param: str, says: str
) -> None:
    r = HTTP.post(f"{image_demo}/v1/images/generations", json={"prompt": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_an_image_pipeline_refuses_text_and_speech(image_demo: str) -> None:
    c = openai_client(image_demo)
    with pytest.raises(openai.BadRequestError, match="cannot output audio; it outputs image"):
        c.audio.speech.create(model="tiny-image", input="hello", voice="alloy")
    with pytest.raises(openai.BadRequestError, match="cannot output text; it outputs image"):
        c.chat.completions.create(model="tiny-image", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        c.images.generate(model="other", prompt="x")
    [model] = c.models.list().data
    assert model.id == "tiny-image" and (model.model_extra or {})["modalities"] == ["image"]


def test_an_image_pipeline_refuses_to_edit(image_demo: str) -> None:
    """tiny-image makes images from a prompt alone: an edit is a 400 naming `image`."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    with pytest.raises(openai.BadRequestError, match="does not edit images") as err:
        openai_client(image_demo).images.edit(image=("a.png", buf.getvalue(), "image/png"), prompt="edit")
    assert err.value.param == "image"


def test_every_response_conforms_to_openais_schema(image_demo: str) -> None:
    """A whole response, every stream event and an error body, validated against OpenAI's own
    OpenAPI description (with our sizes allowed, as its README says); usage counts the
    prompt's tokens as the text encoder read them."""
    body = {"model": "tiny-image", "prompt": "a city of glass", "size": "64x32", "num_inference_steps": 8}
    whole = HTTP.post(f"{image_demo}/v1/images/generations", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    usage = whole.json()["usage"]
    assert usage["input_tokens"] == usage["input_tokens_details"]["text_tokens"] > 0
    stream = HTTP.post(f"{image_demo}/v1/images/generations", json={**body, "stream": True}, timeout=120)
    events = sse_data(stream.text)
    assert events[-1]["type"] == "image_generation.completed" and events[-1]["usage"] == usage
    bad = HTTP.post(f"{image_demo}/v1/images/generations", json={**body, "n": 11}, timeout=30)
    assert bad.status_code == 400
    checked = [
        (whole.json(), "ImagesResponse"),
        *[(e, "ImageGenStreamEvent") for e in events],
        (bad.json(), "ErrorResponse"),
    ]
    problems = [v for b, schema in checked if (v := violations(b, schema)) is not None]
    assert problems == [], problems
