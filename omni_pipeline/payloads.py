"""What each kind of edge carries: a payload between two stages (or a stage and the gateway) is
a dict of tensors along units (dim 0) and metadata, one TypedDict a kind. Producers build them
by keyword (`Codes(codes=...)`), consumers read the keys declared here; `gather` and `KEYS`
refuse a key no kind declares, so a misspelt one fails at once instead of reading None.

The kinds, by edge:
- `Tokens`: an autoregressive LM's tokens (transformers, vLLM), to a talker or a processor.
- `InputsEmbeds`: embeddings a processor made of another stage's hidden states, for an LM.
- `ThinkerStep`: Qwen-Omni's thinker to its talker: the tokens, their embeddings and last
  hidden states; the prompt's with the first token (and, for Qwen3-Omni, its ids and layout).
- `EncodedMedia`: an encoder stage's media embeddings and their layout, to the thinker.
- `Codes`: a talker's codec codes, to its code2wav / vocoder.
- `Audio`: waveform samples, the final output of a speech pipeline.
- `PromptEmbeds`: a diffusion pipeline's text encoder output, to its denoiser.
- `Latents`: a denoiser's latents per step, to its VAE decoder (video adds `steps`, `fps`).
- `Images` / `VideoFrames`: decoded pixels per step, the final output of a diffusion pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch


class Tokens(TypedDict, total=False):
    token_ids: torch.Tensor
    """int64 [units]."""
    hidden_states: torch.Tensor
    """The last layer's hidden states [units, hidden], where the stage returns them."""


class InputsEmbeds(TypedDict):
    inputs_embeds: torch.Tensor
    """[units, hidden]."""


class ThinkerStep(TypedDict, total=False):
    token_ids: torch.Tensor
    prompt_embeds: torch.Tensor
    """With the first token only: the prompt's input embeddings [1, P, hidden]."""
    prompt_hidden: torch.Tensor
    """With the first token only: the prompt's last hidden states [1, P, hidden]."""
    prompt_ids: torch.Tensor
    """Qwen3-Omni, with the first token: the prompt's ids [1, P]."""
    prompt_audio_lengths: torch.Tensor
    """Qwen3-Omni, with the first token: the prompt media's layout (`Layout`), each [1, ...]."""
    prompt_image_grid_thw: torch.Tensor
    prompt_video_grid_thw: torch.Tensor
    prompt_video_second_per_grid: torch.Tensor
    reply_embeds: torch.Tensor
    """From the second token: the embeddings of the token before [units, hidden]."""
    reply_hidden: torch.Tensor
    """From the second token, where the talker reads them: its last hidden states [units, hidden]."""


class EncodedMedia(TypedDict, total=False):
    audio_embeds: torch.Tensor
    image_embeds: torch.Tensor
    video_embeds: torch.Tensor
    audio_lengths: torch.Tensor
    image_grid_thw: torch.Tensor
    video_grid_thw: torch.Tensor
    video_second_per_grid: torch.Tensor
    image_deepstack: torch.Tensor
    video_deepstack: torch.Tensor


class Codes(TypedDict):
    codes: torch.Tensor
    """int64 [units] (Qwen2.5-Omni) or [units, codebooks] (Qwen3-Omni)."""
    context: NotRequired[int]
    """How many of the request's first codes are context for the decoder, never voiced (a voice
    cloned in context: its clip's own codes, which the speech after them continues)."""


class Audio(TypedDict, total=False):
    audio: torch.Tensor
    """float32 samples [units]."""
    sample_rate: int


class PromptEmbeds(TypedDict, total=False):
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    image_latents: torch.Tensor
    """An edit's input image through the VAE."""
    image_size: torch.Tensor
    """An edit's input image's (height, width)."""


class Latents(TypedDict, total=False):
    latents: Any
    """[units, ...] latents (images), or a list of one per unit, None in a progress unit (video)."""
    step: torch.Tensor
    steps: torch.Tensor
    final: torch.Tensor
    fps: int


class Images(TypedDict):
    images: torch.Tensor
    """uint8 [units, n, H, W, 3]."""
    step: torch.Tensor
    final: torch.Tensor


class VideoFrames(TypedDict):
    frames: list[Any]
    """One per unit: uint8 [n, F, H, W, 3] in the final unit, None in a progress unit."""
    step: torch.Tensor
    steps: torch.Tensor
    final: torch.Tensor
    fps: int


KINDS: Final = (
    Tokens,
    InputsEmbeds,
    ThinkerStep,
    EncodedMedia,
    Codes,
    Audio,
    PromptEmbeds,
    Latents,
    Images,
    VideoFrames,
)

KEYS: Final = frozenset(key for kind in KINDS for key in kind.__annotations__)
"""Every key a kind declares."""


def declared(key: str) -> str:
    """`key`, if a kind declares it."""
    if key not in KEYS:
        raise KeyError(f"no payload kind declares the key {key!r}")
    return key


def gather(inputs: Mapping[str, Mapping[str, Any]], key: str) -> list[Any]:
    """The values of `key` in each producer's payload that has it, in the producers' order."""
    declared(key)
    return [p[key] for p in inputs.values() if key in p]
