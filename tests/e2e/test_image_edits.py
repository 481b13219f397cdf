"""Image editing end to end: `omni serve examples/tiny-image-edit.yaml` (Qwen-Image-Edit as
three stages: random weights, real diffusers loading and sampling) and the official openai
client's `images.edit`; the gateway's media limits lowered in the served copy so a test can
cross them."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import yaml
from PIL import Image

from tests.e2e.test_batches import batch_of, ended, lines_of
from tests.helpers import HTTP, ROOT, openai_client, served, sse_data
from tests.openai_schema import violations

pytestmark = pytest.mark.slow

MAX_BYTES = 100_000
MAX_PIXELS = 512 * 512


@pytest.fixture(scope="module")
def edit_demo(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pipeline = demo_dir / "tiny-image-edit-limits.yaml"
    doc = yaml.safe_load((ROOT / "examples" / "tiny-image-edit.yaml").read_text())
    doc["spec"]["gateway"]["media"] = {"maxImageBytes": MAX_BYTES, "maxImagePixels": MAX_PIXELS}
    pipeline.write_text(yaml.safe_dump(doc))
    logs = tmp_path_factory.mktemp("logs")
    with served(pipeline, demo_dir, logs / "serve.log") as (_, base):
        yield base


def png(rgb: np.ndarray, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)


def decode(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def test_an_edit_is_an_image_of_the_inputs_size(edit_demo: str) -> None:
    r = openai_client(edit_demo).images.edit(
        model="tiny-image-edit",
        image=("cat.png", png(picture(48, 64)), "image/png"),
        prompt="give the cat a hat",
        n=2,
        extra_body={"num_inference_steps": 3, "seed": 5},
    )
    assert r.data is not None and len(r.data) == 2 and r.size == "64x48"
    images = [decode(d.b64_json or "") for d in r.data]
    assert all(img.size == (64, 48) and img.format == "PNG" for img in images)
    assert np.asarray(images[0]).tobytes() != np.asarray(images[1]).tobytes()  # each its own noise
    assert r.usage is not None and r.usage.input_tokens > 0

    # The same seed is the same image; vLLM-Omni's true_cfg_scale is guidance_scale's name here.
    def one(**extra: object) -> bytes:
        got = openai_client(edit_demo).images.edit(
            image=("cat.png", png(picture(48, 64)), "image/png"),
            prompt="give the cat a hat",
            size="32x32",
            extra_body={"num_inference_steps": 2, "seed": 9, "negative_prompt": "blur", **extra},
        )
        assert got.data is not None
        return base64.b64decode(got.data[0].b64_json or "")

    assert one(true_cfg_scale=6.0) == one(guidance_scale=6.0) != one(guidance_scale=1.0)


def test_the_mask_keeps_what_it_covers(edit_demo: str) -> None:
    """Only the mask's fully transparent pixels change: the rest is the input, pixel for pixel."""
    rgb = picture(32, 48, seed=2)
    alpha = np.full((32, 48), 255, np.uint8)
    alpha[8:24, 16:32] = 0
    mask = png(np.dstack([rgb, alpha]), "RGBA")
    r = openai_client(edit_demo).images.edit(
        image=("in.png", png(rgb), "image/png"),
        mask=("mask.png", mask, "image/png"),
        prompt="a window here",
        extra_body={"num_inference_steps": 2, "seed": 1},
    )
    assert r.data is not None
    out = np.asarray(decode(r.data[0].b64_json or ""))
    kept = alpha == 255
    assert (out[kept] == rgb[kept]).all()
    assert (out[~kept] != rgb[~kept]).any()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_a_batch_of_json_edits_edits_as_the_form_does(edit_demo: str) -> None:
    """A batch of /v1/images/edits lines, each OpenAI's JSON edit (images and mask as
    `image_url`s): an edit equal to the same edit sent as the SDK's form, its mask honoured;
    a reference the gateway does not serve, or cannot read, is a refused line naming it."""
    client = openai_client(edit_demo)
    rgb = picture(32, 48, seed=4)
    alpha = np.full((32, 48), 255, np.uint8)
    alpha[4:20, 8:40] = 0
    mask = png(np.dstack([rgb, alpha]), "RGBA")
    fields = {"prompt": "a door here", "num_inference_steps": 2, "seed": 11}
    form = client.images.edit(
        image=("in.png", png(rgb), "image/png"),
        mask=("mask.png", mask, "image/png"),
        prompt="a door here",
        extra_body={"num_inference_steps": 2, "seed": 11},
    )
    assert form.data is not None

    def line(custom_id: str, **body: object) -> dict[str, object]:
        body = {**fields, **body}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/images/edits", "body": body}

    image = {"image_url": data_url(png(rgb))}
    lines = [
        line("json", images=[image], mask={"image_url": data_url(mask)}),
        line("file-id", images=[{"file_id": "file-abc"}]),
        line("fetch", images=[image, {"image_url": "https://example.com/cat.png"}]),
        line("no-image", images=[]),
    ]
    batch = batch_of(client, lines, endpoint="/v1/images/edits")
    done = ended(client, batch.id)
    assert done.status == "completed", done
    [out] = lines_of(client, done.output_file_id)
    assert out["custom_id"] == "json" and out["response"]["status_code"] == 200
    assert violations(out["response"]["body"], "ImagesResponse") is None
    edited = decode(out["response"]["body"]["data"][0]["b64_json"])
    assert np.array_equal(np.asarray(edited), np.asarray(decode(form.data[0].b64_json or "")))
    errors = lines_of(client, done.error_file_id)
    refused = {x["custom_id"]: x["response"]["body"]["error"]["param"] for x in errors}
    assert refused == {"file-id": "images[0].file_id", "fetch": "images[1].image_url", "no-image": "image"}


def test_a_stream_sends_edit_previews_then_the_image(edit_demo: str) -> None:
    stream = openai_client(edit_demo).images.edit(
        image=("in.png", png(picture(32, 32)), "image/png"),
        prompt="brighter",
        stream=True,
        partial_images=2,
        extra_body={"num_inference_steps": 6},
    )
    events = [(ev.type, decode(ev.b64_json)) for ev in stream]
    assert [k for k, _ in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert all(img.size == (32, 32) for _, img in events)


def test_every_edit_response_conforms_to_openais_schema(edit_demo: str) -> None:
    files = {"image": ("in.png", png(picture(32, 32)), "image/png")}
    data = {"prompt": "brighter", "num_inference_steps": "2"}
    whole = HTTP.post(f"{edit_demo}/v1/images/edits", files=files, data=data, timeout=120)
    assert whole.status_code == 200, whole.text
    stream = HTTP.post(
        f"{edit_demo}/v1/images/edits", files=files, data={**data, "stream": "true"}, timeout=120
    )
    events = sse_data(stream.text)
    assert events[-1]["type"] == "image_edit.completed"
    bad = HTTP.post(f"{edit_demo}/v1/images/edits", files=files, data={**data, "n": "11"}, timeout=30)
    assert bad.status_code == 400
    checked = [
        (whole.json(), "ImagesResponse"),
        *[(e, "ImageEditStreamEvent") for e in events],
        (bad.json(), "ErrorResponse"),
    ]
    problems = [v for b, schema in checked if (v := violations(b, schema)) is not None]
    assert problems == [], problems


def noise_png(side: int) -> bytes:
    return png(picture(side, side, seed=3))


@pytest.mark.parametrize(
    ("files", "fields", "param", "says"),
    [
        ({"image": ("a.png", b"not an image at all", "image/png")}, {}, "image", "not an image"),
        ({"image": ("a.png", png(np.zeros((600, 600, 3), np.uint8)), "image/png")}, {}, "image", "pixels"),
        ({"image": ("a.png", noise_png(200), "image/png")}, {}, "image", f"limit of {MAX_BYTES}"),
        (
            {
                "image": ("a.png", png(picture(32, 32)), "image/png"),
                "mask": ("m.png", png(np.zeros((16, 32, 4), np.uint8), "RGBA"), "image/png"),
            },
            {},
            "mask",
            "32x16, not the size of the image (32x32)",
        ),
        (
            {"image": ("a.png", png(picture(32, 32)), "image/png"), "mask": ("m.png", png(picture(32, 32)))},
            {},
            "mask",
            "no alpha channel",
        ),
        ({}, {}, "image", "needs an image"),
        ({"image": ("a.png", png(picture(32, 32)), "image/png")}, {"size": "40x32"}, None, "multiples of 16"),
        (
            {"image": ("a.png", png(picture(32, 32)), "image/png")},
            {"background": "transparent"},
            "background",
            "not served",
        ),
        (
            {"image": ("a.png", png(picture(32, 32)), "image/png")},
            {"input_fidelity": "high"},
            "input_fidelity",
            "not served",
        ),
        (
            {"image": ("a.png", png(picture(32, 32)), "image/png")},
            {"guidance_scale": "2", "true_cfg_scale": "3"},
            "true_cfg_scale",
            "send one of them",
        ),
        (
            {"image": ("a.png", png(picture(32, 32)), "image/png")},
            {"colour": "red"},
            "colour",
            "unrecognized",
        ),
    ],
    ids=[
        "not-an-image",
        "too-many-pixels",
        "too-many-bytes",
        "mask-of-another-size",
        "mask-without-alpha",
        "no-image",
        "size-the-model-cannot-make",
        "transparent",
        "fidelity",
        "two-scales",
        "unknown-field",
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    edit_demo: str, files: dict[str, object], fields: dict[str, str], param: str | None, says: str
) -> None:
    r = HTTP.post(
        f"{edit_demo}/v1/images/edits",
        files=files or {"n": (None, "1")},  # a form without files
        data={"prompt": "edit", "num_inference_steps": "1", **fields},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_the_sdk_sees_a_400_for_a_file_that_is_not_an_image(edit_demo: str) -> None:
    with pytest.raises(openai.BadRequestError, match="not an image"):
        openai_client(edit_demo).images.edit(image=("notes.txt", b"hello", "text/plain"), prompt="edit")
