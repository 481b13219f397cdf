"""Constrained decoding for the step-loop engines: OpenAI's `response_format` and vLLM's
`structured_outputs` (a JSON schema, a regex, a choice of strings, an EBNF grammar) through
xgrammar, the grammar engine vLLM itself uses, compiled as vLLM's xgrammar backend compiles
them (JSON with any whitespace, a choice as a grammar of its alternatives), so a constrained
reply is the same on every engine.

xgrammar is the `structured` extra (vLLM's extras bring it too); without it an engine declares
neither field, and the gateway refuses them.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any

import torch

from omni_pipeline.sampling import Sampling
from omni_stage.engines.base import InvalidRequest

AVAILABLE = importlib.util.find_spec("xgrammar") is not None


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a reply must match: `kind` json (a schema), regex, choice or grammar (EBNF), and
    the request field that asked for it (named in a refusal)."""

    field: str
    kind: str
    source: str | list[str]


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The keys of `structured_outputs`, as the gateway passes it on (exactly one set)."""


def grammar_of(sampling: Sampling, schema: str | None = None) -> Grammar | None:
    """The grammar a request's sampling asks for: `schema` (a tool choice's) first, then its
    `response_format`, then its `structured_outputs`; None if none."""
    if schema is not None:
        return Grammar("tool_choice", "json", schema)
    if response_format := sampling.response_format:
        return Grammar("response_format", "json", schema_of(response_format))
    if structured := sampling.structured_outputs:
        (kind, source), *_ = structured.items()
        if kind == "json_object":
            return Grammar("structured_outputs", "json", '{"type": "object"}')
        if kind == "json" and not isinstance(source, str):
            source = json.dumps(source)
        return Grammar("structured_outputs", kind, source)
    return None


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

    def constraint(self, grammar: Grammar) -> JsonConstraint:
        import xgrammar as xgr

        try:
            if grammar.kind == "json":
                compiled = self.compiler.compile_json_schema(grammar.source, any_whitespace=True)
            elif grammar.kind == "regex":
                compiled = self.compiler.compile_regex(str(grammar.source))
            elif grammar.kind == "choice":
                alternatives = " | ".join(json.dumps(str(c)) for c in grammar.source)
                compiled = self.compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = self.compiler.compile_grammar(str(grammar.source))
        except (RuntimeError, ValueError) as exc:  # "[time] file.cc:line: what is wrong"
            why = str(exc).rsplit(": ", 1)[-1].strip()
            what = "schema" if grammar.kind == "json" else grammar.kind
            raise InvalidRequest(f"{grammar.field}: the {what} cannot be used: {why}") from None
        return JsonConstraint(xgr.GrammarMatcher(compiled), self.vocab_size)


class JsonConstraint:
    """One request's place in its grammar: which tokens may come next. A grammar that has
    accepted its end (a stop token the reply went past, under `ignore_eos`) constrains nothing
    further, as in vLLM, which masks and advances a grammar only until it has terminated."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Every token the grammar forbids next to -inf, in place (`logits` [vocab], float32)."""
        import xgrammar as xgr

        if self.matcher.is_terminated():
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(
            logits.unsqueeze(0), self.bitmask.to(logits.device, non_blocking=True)
        )

    def accept(self, token: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} it had allowed")
