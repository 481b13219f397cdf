"""Qwen2.5-Omni's thinker prompt: chat messages with audio, images and videos -> token ids
and the features its encoders read, as `Qwen2_5OmniProcessor` builds them.

The processor's parts are loaded the way it loads them: the checkpoint's Whisper feature
extractor (16 kHz; the features of its 300 s window, with the mask, see `audio_features`),
its Qwen2-VL image processor
(`AutoImageProcessor`, the backend transformers picks) and its video processor
(`AutoVideoProcessor`), and its placeholder expansion is done here: each `<|AUDIO|>` becomes
one token per audio frame the encoder outputs (`((mask.sum() - 1) // 2 + 1 - 2) // 2 + 1`),
each `<|IMAGE|>` and `<|VIDEO|>` one per merged patch (`grid_thw.prod() // merge_size**2`), in
the order they appear; a video's seconds per temporal patch (`temporal_patch_size / fps`) place
its frames in time for the M-RoPE positions. Not the processor itself, because it cannot be
built where torchvision is missing (transformers 5 makes the video processor torchvision-only,
and the processor always builds one): there the thinker reads audio and images, and says it
does not read video. The parity tests build their inputs with the processor's own code and
compare token for token.

The media's layout (`Layout`: audio lengths, image and video grids, seconds per temporal
patch) is all the expansion and the positions need, so the thinker builds the same prompt from
an encoder stage's outputs (`MediaEmbeds`) as from the media. It also tells which rows of the
features (or of the encoders' outputs) are which item's: a prompt whose first positions a kept
sequence holds is prefilled from the rest alone (`Prompts.after`), and each item's digest tells
one clip from another of the same length (`Prompts.media_spans`).

Media arrive decoded by the gateway (RGB uint8 [H, W, 3]; RGB frames [T, H, W, 3] with the
rate they were taken at; mono float32 PCM with its rate, resampled here to the feature
extractor's rate with soxr, as librosa loads it by default). A video's own audio is not read
(the processor's `use_audio_in_video` off, as it defaults).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final

import numpy as np
import torch

from omni_pipeline.payloads import EncodedMedia, declared
from omni_pipeline.sampling import EMPTY, Sampling
from omni_stage.engines.base import EngineError, InvalidRequest
from omni_stage.engines.prompt_cache import MediaSpan, digest
from omni_stage.engines.prompts import chat_template_args
from omni_stage.models.qwen_omni.audio_features import AudioFeatures

KINDS: Final = ("audio", "image", "video")
"""The media kinds, in the order of their placeholder tokens, layouts and masks here."""

PROCESSOR_KWARGS = frozenset({"min_pixels", "max_pixels"})
"""What of vLLM's `mm_processor_kwargs` the Qwen processors here take: the pixel bounds an image
or a video frame is resized within (the omni processor hands them to both, as here)."""
_PIXELS = (28 * 28, 1 << 26)


def processor_kwargs(sampling: Sampling) -> dict[str, int]:
    """A request's `mm_processor_kwargs`, checked: a 400 for any other key or a bad bound."""
    asked = dict(sampling.mm_processor_kwargs or {})
    if unknown := sorted(set(asked) - PROCESSOR_KWARGS):
        raise InvalidRequest(
            f"mm_processor_kwargs.{unknown[0]}: not taken by this model's processors here "
            f"(they take {', '.join(sorted(PROCESSOR_KWARGS))})"
        )
    for key, value in asked.items():
        if not isinstance(value, int) or isinstance(value, bool) or not _PIXELS[0] <= value <= _PIXELS[1]:
            raise InvalidRequest(
                f"mm_processor_kwargs.{key}: {value!r} is not a pixel count from 784 to 2^26"
            )
    if asked.get("min_pixels", 0) > asked.get("max_pixels", _PIXELS[1]):
        raise InvalidRequest("mm_processor_kwargs: min_pixels is more than max_pixels")
    return asked


@dataclass(frozen=True)
class Layout:
    """How many prompt positions each media item takes and where it sits in time: what the
    placeholder expansion and the M-RoPE positions read, whichever process ran the encoders."""

    audio_lengths: torch.Tensor | None = None
    """Feature frames of each audio (its feature mask's sum), [A] int64."""
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    """Each video's seconds per temporal patch, [V] float32 (not the model's dtype)."""

    def tokens(
        self, merge: int, audio_tokens: Callable[[torch.Tensor], list[int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Positions of each audio (`audio_tokens` of its length), image and video, in order;
        `merge` patches make one."""
        audio = [] if self.audio_lengths is None else audio_tokens(self.audio_lengths)
        patches = lambda grid: [] if grid is None else (grid.prod(-1) // merge).tolist()  # noqa: E731
        return audio, patches(self.image_grid_thw), patches(self.video_grid_thw)

    def on(self, device: torch.device) -> Layout:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Layout(*(move(getattr(self, f.name)) for f in fields(self)))

    def after(self, audio: int, image: int, video: int) -> Layout:
        """The layout of the items past the first `audio`, `image` and `video` of each kind."""
        rest = lambda t, n: None if t is None or n >= len(t) else t[n:]  # noqa: E731
        return Layout(
            rest(self.audio_lengths, audio),
            rest(self.image_grid_thw, image),
            rest(self.video_grid_thw, video),
            rest(self.video_second_per_grid, video),
        )


LAYOUT_KEYS: Final = tuple(f.name for f in fields(Layout))
"""A layout's keys, as payloads carry them (an encoder's as they are, a thinker's with `prompt_`)."""


@dataclass(frozen=True)
class EncoderInputs:
    """What the model's processors make of a request's media: the encoders' inputs (the
    model's own argument names: `input_features`, `pixel_values`, ...) and their layout."""

    features: dict[str, torch.Tensor]
    layout: Layout


@dataclass(frozen=True)
class MediaEmbeds:
    """The encoders' outputs for one request's media, each kind's items' rows in order, with
    their layout: what an encoder stage sends the thinker in place of the media."""

    audio: torch.Tensor | None
    image: torch.Tensor | None
    video: torch.Tensor | None
    layout: Layout
    image_deepstack: torch.Tensor | None = None
    """Qwen3-Omni: the vision encoder's features for the thinker's first layers, [layers, N, H]."""
    video_deepstack: torch.Tensor | None = None

    _KINDS: ClassVar = KINDS
    _DEEPSTACK: ClassVar = ("image_deepstack", "video_deepstack")

    def to_payload(self) -> EncodedMedia:
        out = {f"{k}_embeds": getattr(self, k) for k in self._KINDS}
        out |= {k: getattr(self.layout, k) for k in LAYOUT_KEYS}
        out |= {k: getattr(self, k) for k in self._DEEPSTACK}
        return EncodedMedia(**{declared(k): v for k, v in out.items() if v is not None})

    @classmethod
    def from_payload(cls, payload: EncodedMedia) -> MediaEmbeds | None:
        """The embeddings a payload carries; None if it carries none."""
        if not any(f"{k}_embeds" in payload for k in cls._KINDS):
            return None
        layout = Layout(*(payload.get(k) for k in LAYOUT_KEYS))
        deepstack = {k: payload.get(k) for k in cls._DEEPSTACK}
        return cls(*(payload.get(f"{k}_embeds") for k in cls._KINDS), layout, **deepstack)


@dataclass(frozen=True)
class Prompt:
    """The thinker's prompt: ids [1, P] and its media: either the encoders' inputs (`features`,
    run by the thinker's own encoders in the prefill) or their outputs (`embeds`, from an
    encoder stage); which positions hold media (the talker gets zeros there)."""

    ids: torch.Tensor
    layout: Layout = Layout()
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    embeds: MediaEmbeds | None = None
    media_mask: torch.Tensor | None = None


@dataclass
class Chat:
    """A request's messages as the chat template writes them, and their media, in order."""

    text: str
    audios: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)
    video_fps: list[float] = field(default_factory=list)


class Prompts:
    audio_class: ClassVar[type[AudioFeatures]] = AudioFeatures
    """What the model hears, as its processor computes it (Qwen3-Omni's pads differently)."""

    def __init__(
        self, path: str, tokenizer: Any, thinker_config: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        from transformers import AutoImageProcessor, AutoVideoProcessor
        from transformers.utils import is_torchvision_available

        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.audio_token: str = tokenizer.audio_token
        self.image_token: str = tokenizer.image_token
        self.video_token: str = tokenizer.video_token
        placeholders = (self.audio_token, self.image_token, self.video_token)
        self.media_ids = torch.tensor([int(tokenizer.convert_tokens_to_ids(t)) for t in placeholders])
        self.audio = self.audio_class(path)
        self.images = AutoImageProcessor.from_pretrained(path)
        self.videos = AutoVideoProcessor.from_pretrained(path) if is_torchvision_available() else None
        # The omni processor resizes video frames to its own bounds, not its video processor's.
        self.video_size = self._processor_defaults()["videos_kwargs"]["size"]
        self.merge = int(self.images.merge_size) ** 2
        tokens = (self.audio_token, self.image_token, self.video_token)
        self._placeholder = re.compile("|".join(re.escape(t) for t in tokens))

    @staticmethod
    def _processor_defaults() -> dict[str, Any]:
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessorKwargs

        return Qwen2_5OmniProcessorKwargs._defaults

    def audio_tokens(self, lengths: torch.Tensor) -> list[int]:
        """Positions each audio takes, from its feature frames: its encoder's output length."""
        frames = (lengths - 1) // 2 + 1
        return ((frames - 2) // 2 + 1).tolist()

    def layout_tokens(self, layout: Layout) -> tuple[list[int], list[int], list[int]]:
        return layout.tokens(self.merge, self.audio_tokens)

    @property
    def accepts(self) -> frozenset[str]:
        """The content part kinds this prompt reads."""
        return frozenset({"text", "image", "audio"} | ({"video"} if self.videos is not None else set()))

    def read(self, request: dict[str, Any], decode: bool = True, sampling: Sampling = EMPTY) -> Chat:
        """The chat template's text (placeholders not yet expanded) and the media, in order:
        audio at the feature extractor's rate, images, videos and the rates of their frames.
        `decode=False`: the text only, with no media (an encoder stage has read them).
        `sampling`: the request's, for the chat template's arguments (prompts.chat_template_args)."""
        media: dict[str, torch.Tensor] = request.get("media") or {}

        def data(part: dict[str, Any]) -> torch.Tensor:
            if (t := media.get(part["media"])) is None:
                raise EngineError(
                    f"a '{part.get('type')}' part came without its data (a `request` edge with media: false) "
                    "and no encoder stage's outputs came in its place"
                )
            return t

        chat: list[dict[str, Any]] = []
        out = Chat("")
        for m in request["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                parts: list[dict[str, str]] = []
                for p in content:
                    kind = p.get("type")
                    if kind == "text":
                        parts.append({"type": "text", "text": str(p.get("text", ""))})
                    elif kind == "audio":
                        if decode:
                            out.audios.append(self.audio.resampled(data(p), int(p["sample_rate"])))
                        parts.append({"type": "audio"})
                    elif kind == "image":
                        if decode:
                            out.images.append(data(p).numpy())
                        parts.append({"type": "image"})
                    elif kind == "video" and self.videos is not None:
                        if decode:
                            out.videos.append(data(p).numpy())
                            out.video_fps.append(float(p["fps"]))
                        parts.append({"type": "video"})
                    else:
                        raise InvalidRequest(f"this model cannot read the '{kind}' part")
                content = parts
            chat.append({"role": str(m.get("role", "user")), "content": content or ""})
        try:
            out.text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, **chat_template_args(sampling)
            )
        except ValueError as exc:  # continue_final_message without a final message to continue
            raise InvalidRequest(f"the chat template cannot apply: {exc}") from None
        return out

    def build(
        self,
        request: dict[str, Any],
        embeds: MediaEmbeds | None = None,
        sampling: Sampling = EMPTY,
    ) -> Prompt:
        """The prompt, with the media's features for the thinker's encoders, or with `embeds`,
        their outputs from an encoder stage, in their place."""
        if "messages" not in request:
            return Prompt(self._ids(str(request.get("prompt", ""))))
        chat = self.read(request, decode=embeds is None, sampling=sampling)
        if embeds is None:
            inputs = self.process(chat, sampling)
            layout, features = inputs.layout, inputs.features
        else:
            layout, features = embeds.layout, {}
        text = self._expand(chat.text, layout)
        ids = self._ids(text)
        mask = torch.isin(ids, self.media_ids.to(ids.device))
        # On the model's device, and float features in its dtype (as `inputs.to(model.dtype)`).
        dtype = lambda v: self.dtype if v.is_floating_point() else v.dtype  # noqa: E731
        on_device = {k: v.to(self.device, dtype(v)) for k, v in features.items()}
        return Prompt(ids, layout.on(self.device), on_device, embeds, mask)

    def media_spans(self, prompt: Prompt) -> list[MediaSpan]:
        """Each media item's positions in the prompt and a digest of what its encoder reads (or
        what an encoder stage made of it), in the order they come."""
        ids = prompt.ids[0]
        spans = []
        for kind, token, sizes in zip(
            KINDS, self.media_ids.tolist(), self.layout_tokens(prompt.layout), strict=True
        ):
            where = (ids == token).nonzero().flatten().tolist()
            at = 0
            for n, item in zip(sizes, self._items(prompt, kind), strict=True):
                if n:
                    spans.append(MediaSpan(where[at], where[at + n - 1] + 1, digest(*item)))
                at += n
        return sorted(spans, key=lambda m: m.start)

    def _items(self, prompt: Prompt, kind: str) -> list[tuple[torch.Tensor | None, ...]]:
        """Each item of a kind: the tensors that make it what it is."""
        lay, f, e = prompt.layout, prompt.features, prompt.embeds
        if kind == "audio" and lay.audio_lengths is not None:
            if e is not None:
                assert e.audio is not None
                return [(r,) for r in torch.split(e.audio, self.audio_tokens(lay.audio_lengths))]
            lengths = f["feature_attention_mask"].sum(-1).tolist()
            return [(f["input_features"][k, :, :n],) for k, n in enumerate(lengths)]
        grid = lay.image_grid_thw if kind == "image" else lay.video_grid_thw
        if kind == "audio" or grid is None:
            return []
        extra: list[torch.Tensor | None] = list(grid)
        if kind == "video":
            assert lay.video_second_per_grid is not None
            extra = [
                torch.stack([g.float(), t.float().expand(3)])
                for g, t in zip(grid, lay.video_second_per_grid, strict=True)
            ]
        if e is not None:
            rows, deep = (e.image, e.image_deepstack) if kind == "image" else (e.video, e.video_deepstack)
            assert rows is not None
            sizes = (grid.prod(-1) // self.merge).tolist()
            deeps = torch.split(deep, sizes, dim=1) if deep is not None else [None] * len(sizes)
            return list(zip(torch.split(rows, sizes), deeps, extra, strict=True))
        pixels = f["pixel_values" if kind == "image" else "pixel_values_videos"]
        return list(zip(torch.split(pixels, grid.prod(-1).tolist()), extra, strict=True))

    def after(self, prompt: Prompt, start: int) -> Prompt:
        """The prompt from position `start` on, with only the media items there: what a prefill
        on a cache holding the first `start` positions reads. No item may straddle `start`."""
        ids = prompt.ids[0, :start]
        skip = [int((ids == t).sum()) for t in self.media_ids.tolist()]  # positions, per kind
        counts = []  # items, per kind
        for held, sizes in zip(skip, self.layout_tokens(prompt.layout), strict=True):
            n = 0
            while held > 0:
                held -= sizes[n]
                n += 1
            if held:
                raise ValueError(f"position {start} is inside a media item")
            counts.append(n)
        a, i, v = counts
        lay = prompt.layout
        features: dict[str, torch.Tensor] = {}
        f = prompt.features
        if "input_features" in f and a < len(f["input_features"]):
            features |= {k: f[k][a:] for k in ("input_features", "feature_attention_mask")}
        for kind, n, pixels, grid in (
            ("image", i, "pixel_values", lay.image_grid_thw),
            ("video", v, "pixel_values_videos", lay.video_grid_thw),
        ):
            if pixels in f and grid is not None and n < len(grid):
                features[pixels] = f[pixels][int(grid[:n].prod(-1).sum()) :]
                features[f"{kind}_grid_thw"] = grid[n:]
        embeds = None
        if (e := prompt.embeds) is not None:
            tokens = self.layout_tokens(e.layout)

            def rest(rows: torch.Tensor | None, kind: int, n: int, dim: int = 0) -> torch.Tensor | None:
                """The rows of a kind's items past its first `n` (on `dim`); None if none."""
                if rows is None or n >= len(tokens[kind]):
                    return None
                return rows.narrow(dim, sum(tokens[kind][:n]), sum(tokens[kind][n:]))

            embeds = MediaEmbeds(
                rest(e.audio, 0, a),
                rest(e.image, 1, i),
                rest(e.video, 2, v),
                e.layout.after(a, i, v),
                rest(e.image_deepstack, 1, i, 1),
                rest(e.video_deepstack, 2, v, 1),
            )
        mask = None if prompt.media_mask is None else prompt.media_mask[:, start:]
        return Prompt(prompt.ids[:, start:], lay.after(a, i, v), features, embeds, mask)

    def process(self, chat: Chat, sampling: Sampling = EMPTY) -> EncoderInputs:
        """The model's processors on the chat's media: the encoders' inputs, on the CPU, with
        the request's `mm_processor_kwargs` (processor_kwargs)."""
        extra = processor_kwargs(sampling)
        features: dict[str, torch.Tensor] = {}
        lengths = per_grid = None
        if chat.audios:
            features["input_features"], features["feature_attention_mask"] = self.audio.of(chat.audios)
            lengths = features["feature_attention_mask"].sum(-1)
        if chat.images:
            out = self.images(images=chat.images, return_tensors="pt", **extra)
            features["pixel_values"], features["image_grid_thw"] = out["pixel_values"], out["image_grid_thw"]
        if chat.videos:
            assert self.videos is not None
            out = self.videos(videos=chat.videos, size=self.video_size, return_tensors="pt", **extra)
            features["pixel_values_videos"] = out["pixel_values_videos"]
            features["video_grid_thw"] = out["video_grid_thw"]
            patch = int(self.videos.temporal_patch_size)
            per_grid = torch.tensor([patch / fps for fps in chat.video_fps])
        layout = Layout(lengths, features.get("image_grid_thw"), features.get("video_grid_thw"), per_grid)
        return EncoderInputs(features, layout)

    def _expand(self, text: str, layout: Layout) -> str:
        """Each placeholder repeated once per position its item takes."""
        tokens = (self.audio_token, self.image_token, self.video_token)
        counts = dict(zip(tokens, self.layout_tokens(layout), strict=True))
        found = self._placeholder.findall(text)
        for token, n in counts.items():
            if found.count(token) != len(n):  # the text itself spells a placeholder token
                raise InvalidRequest(f"the messages contain the model's special token {token}")
        left = {token: iter(n) for token, n in counts.items()}
        return self._placeholder.sub(lambda m: m.group() * next(left[m.group()]), text)

    def _ids(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] == 0:
            raise InvalidRequest("empty prompt")
        return ids.to(self.device)
