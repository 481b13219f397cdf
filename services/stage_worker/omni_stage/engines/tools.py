"""Tool calls, for every engine that detokenizes its own reply: OpenAI's `tools` and
`tool_choice` served as vLLM's server serves them, with vLLM's own code. A named or `required`
tool choice constrains decoding to vLLM's JSON schema for it (the engine's JSON grammar);
`auto` reads the finished reply with the model family's tool parser, one of vLLM's, named by
`engine.args.toolCallParser` (`hermes` for Qwen2.5 and Qwen3, say).

A named choice's reply is the call's arguments, streamed as they come (fragments of one call,
by id, as OpenAI streams them). A reply that may be a tool call (`required`, `auto`) is held
back until it ends (its text could turn out to be a call), then sent whole: the content, if
any, and the calls.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import uuid
from typing import Any

from omni_pipeline.control import ToolCall
from omni_pipeline.sampling import Sampling, params
from omni_stage.engines import structured
from omni_stage.engines.base import InvalidRequest
from omni_stage.segments import EngineOutput

AVAILABLE = importlib.util.find_spec("vllm") is not None
log = logging.getLogger(__name__)


def engine_honours(honours: frozenset[str]) -> frozenset[str]:
    """What an engine with a JSON grammar honours, with `tools` where vLLM's tool code is
    installed. (Without a parser only named and `required` tool choices are served; `auto`
    is then refused by the engine, before any output.)"""
    if not (AVAILABLE and structured.AVAILABLE and "response_format" in honours):
        return honours
    return honours | params("tools", "tool_choice", "parallel_tool_calls")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(sampling: Sampling, tokenizer: Any, parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan, where it offers tools; None where it offers none. Slow the first
    time (vLLM's tool code imports): call it off the loop."""
    return ToolPlan(sampling, tokenizer, parser) if sampling.tools else None


class ToolPlan:
    """One request's tools: the schema its reply must follow (None for `auto`), and how the
    finished reply becomes calls. Built on the compute thread (vLLM imports slowly)."""

    def __init__(self, sampling: Sampling, tokenizer: Any, parser: str | None) -> None:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        try:
            self.request = ChatCompletionRequest(
                model="omni",
                messages=[],
                tools=sampling.tools,
                tool_choice=sampling.tool_choice if sampling.tool_choice is not None else "auto",
                parallel_tool_calls=sampling.parallel_tool_calls,
            )
            schema = get_json_schema_from_tools(
                self.request.tool_choice, self.request.tools, self.request.parallel_tool_calls
            )
        except (ValidationError, ValueError) as exc:
            raise InvalidRequest(f"tools: {exc}") from None
        choice = self.request.tool_choice
        self.named: str | None = None if isinstance(choice, str) else choice.function.name
        self.required = choice == "required"
        self.schema = None if schema is None else json.dumps(schema)
        self.parser: Any = None
        if self.schema is None:  # auto: the model decides, its parser reads what it wrote
            if parser is None:
                raise InvalidRequest(
                    "tool_choice: 'auto' needs the model's tool call parser, and this model's engine "
                    "names none (engine.args.toolCallParser); a named or 'required' tool choice works"
                )
            self.parser = ToolParserManager.get_tool_parser(parser)(tokenizer, self.request.tools)
        self.text: list[str] = []
        self.call_id = _call_id()  # a named choice's one call

    def settle(self, out: EngineOutput, last: bool) -> EngineOutput:
        """An output of the reply, its text turned into the named call's arguments, or held
        back; on the last one, the reply's content and calls."""
        if self.named is not None:  # the first fragment names the call; the rest extend it
            if out.text or not self.text:
                out.tool_calls = [ToolCall(self.call_id, self.named, out.text)]
            self.text.append(out.text)
            out.text = ""
            return out
        self.text.append(out.text)
        out.text = ""
        if last:
            out.text, out.tool_calls = self.finish()
            out.finish_reason = self.finish_reason(out.finish_reason, out.tool_calls)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply's content and its calls, from everything held."""
        text = "".join(self.text)
        if self.required:
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no calls, as vLLM answers
                return text, []
            return "", [ToolCall(_call_id(), c["name"], json.dumps(c["parameters"])) for c in calls]
        try:
            found = self.parser.extract_tool_calls(text, self.request)
        except Exception:  # a parser that cannot read the reply: it is text, as vLLM answers
            log.warning("tool parser failed on a reply; returning it as text", exc_info=True)
            return text, []
        if not found.tools_called:
            return text, []
        calls = [ToolCall(_call_id(), c.function.name, c.function.arguments) for c in found.tool_calls]
        if self.request.parallel_tool_calls is False:  # one call at most, as vLLM's server keeps
            calls = calls[:1]
        return found.content or "", calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        """OpenAI's: `tool_calls` when the model chose to call (not for a named choice)."""
        return "tool_calls" if calls and reason == "stop" and self.named is None else reason
