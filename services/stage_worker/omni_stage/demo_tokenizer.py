"""The byte-level BPE tokenizer of every tiny demo checkpoint (printable ASCII, so whatever a
random-weight model says is readable); each checkpoint writer adds its own special tokens."""

from __future__ import annotations

from typing import Any


def byte_level_tokenizer(
    chat_template: str,
    special_tokens: list[str],
    roles: dict[str, str] | None = None,
    ordinary: int = 0,
) -> Any:
    """A byte-level BPE tokenizer over printable ASCII (whatever a random model says is
    readable), `<|im_end|>` its eos and `<|endoftext|>` its pad, with `special_tokens` and the
    named `roles` (`image_token: <|IMAGE|>`, as a processor looks them up).

    `ordinary`: how many ids the ordinary tokens take (the characters, then two-character
    merges), `<unk>` and the special tokens coming after them as in the real vocabularies
    (Qwen's at ~151k). A
    model whose talker emits codes below that count never sees a code that reads as one of its
    special tokens (a media placeholder, say)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = dict(zip(_printable_bytes(), _byte_level_chars(), strict=True))
    vocab = {c: i for i, c in enumerate(byte_to_char.values())}
    merges = _pair_merges(list(byte_to_char.values()), ordinary - len(vocab))
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(merges)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special_tokens,
        **({"extra_special_tokens": roles} if roles else {}),
    )
    # Named roles replace the additional special tokens given beside them (transformers 5): add
    # what is missing, each its own id, as in the real tokenizers (none of it may read <unk>).
    missing = [t for t in special_tokens if fast.convert_tokens_to_ids(t) == fast.unk_token_id]
    fast.add_tokens(missing, special_tokens=True)
    fast.chat_template = chat_template
    return fast


def _pair_merges(chars: list[str], n: int) -> list[tuple[str, str]]:
    """The first `n` merges of two characters (every pair is one token: printable still)."""
    if n > len(chars) ** 2:
        raise ValueError(f"at most {len(chars) ** 2} two-character merges; asked {n}")
    return [(a, b) for a in chars for b in chars][: max(n, 0)]


def _printable_bytes() -> list[int]:
    return [0x0A, *range(0x20, 0x7F)]


def _byte_level_chars() -> list[str]:
    # GPT-2's byte-to-unicode map for these bytes: printable ASCII maps to itself, space and
    # newline to the shifted code points U+0120 and U+010A.
    return ["\u010a", "\u0120", *(chr(b) for b in range(0x21, 0x7F))]
