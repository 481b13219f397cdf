"""JSON mode for the step-loop engines: OpenAI's `response_format` through xgrammar, the grammar
engine vLLM itself uses, compiled as vLLM's xgrammar backend compiles it (any whitespace), so
a constrained reply is the same on every engine.

xgrammar is the `structured` extra (vLLM's extras bring it too); without it an engine does not
declare `response_format`, and the gateway refuses it.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import torch

from omni_stage.engines.base import InvalidRequest

AVAILABLE = importlib.util.find_spec("xgrammar") is not None


def schema_of(response_format: dict[str, Any]) -> str:
    """The JSON schema a request's `response_format` (as the gateway passes it on) asks for:
    any object for `json_object`, else its own."""
    if response_format.get("type") == "json_object":
        return '{"type": "object"}'
    return json.dumps(response_format.get("schema") or {})


class JsonGrammars:
    """One model's grammar compiler (its vocabulary, read once); grammars are cached by schema."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self.vocab_size = vocab_size

    def constraint(self, schema: str) -> JsonConstraint:
        import xgrammar as xgr

        try:
            grammar = self.compiler.compile_json_schema(schema, any_whitespace=True)
        except (RuntimeError, ValueError) as exc:  # "[time] file.cc:line: what is wrong"
            why = str(exc).rsplit(": ", 1)[-1].strip()
            raise InvalidRequest(f"response_format: the schema cannot be used: {why}") from None
        return JsonConstraint(xgr.GrammarMatcher(grammar), self.vocab_size)


class JsonConstraint:
    """One request's place in its grammar: which tokens may come next."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Every token the grammar forbids next to -inf, in place (`logits` [vocab], float32)."""
        import xgrammar as xgr

        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(
            logits.unsqueeze(0), self.bitmask.to(logits.device, non_blocking=True)
        )

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} it had allowed")
