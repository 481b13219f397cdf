"""The payload kinds between stages: a key no kind declares is refused where it is read."""

from __future__ import annotations

import pytest
import torch

from omni_pipeline.payloads import KEYS, Codes, ThinkerStep, Tokens, declared, gather


def test_gather_reads_a_declared_key_from_each_producer_that_sent_it() -> None:
    inputs = {
        "thinker": Tokens(token_ids=torch.tensor([1, 2])),
        "encoder": ThinkerStep(reply_embeds=torch.zeros(1, 4)),
        "talker": Tokens(token_ids=torch.tensor([3])),
    }
    assert [t.tolist() for t in gather(inputs, "token_ids")] == [[1, 2], [3]]
    assert gather(inputs, "codes") == []


def test_a_misspelt_key_is_refused_not_read_as_nothing() -> None:
    inputs = {"talker": Codes(codes=torch.tensor([7]))}
    with pytest.raises(KeyError, match="'code'"):
        gather(inputs, "code")
    with pytest.raises(KeyError, match="'prompt_grid_thw'"):
        declared("prompt_grid_thw")


def test_the_kinds_declare_what_the_thinker_sends_its_talker() -> None:
    assert {"prompt_embeds", "prompt_hidden", "reply_embeds", "reply_hidden", "token_ids"} <= KEYS
    assert {f"prompt_{k}" for k in ("audio_lengths", "image_grid_thw", "video_grid_thw")} <= KEYS
