"""vLLM's and vLLM-Omni's own pieces of the chat request (their dialect of the API): the
grammar fields, one stage's sampling, and the bounds of token ids that travel."""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_pipeline.sampling import Sampling


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a choice of strings,
    an EBNF grammar, or any JSON object."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if len(self.asked()) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object")
        return self

    def asked(self) -> dict[str, Any]:
        """{kind: source}, as the engines take it (structured.STRUCTURED_KINDS)."""
        named = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        out = {k: v for k, v in named.items() if v is not None}
        return out | ({"json_object": True} if self.json_object else {})


TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Count = Annotated[int, Field(ge=0, lt=2**31)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=256)]
AllowedTokenIds = Annotated[list[TokenId], Field(min_length=1)]
"""At least one: none allowed would leave no token to draw (vLLM refuses it too)."""
BadWords = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=256)]

GUIDED: Final = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older names for `structured_outputs`' kinds, still sent by its users' clients."""


class StageSampling(BaseModel):
    """One entry of vLLM-Omni's `sampling_params_list`: the fields of vLLM's SamplingParams this
    server passes on to a stage (`logprobs` there is the count of top tokens); any other is a
    400 naming it."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: AllowedTokenIds | None = None
    bad_words: BadWords | None = None

    def sampling(self) -> Sampling:
        """As the engines take it: the fields set, `stop` a list, `logprobs` OpenAI's pair."""
        own = self.model_dump(exclude_none=True)
        if isinstance(own.get("stop"), str):
            own["stop"] = [own["stop"]]
        if "logprobs" in own:
            own["top_logprobs"], own["logprobs"] = own["logprobs"], True
        return Sampling(**own)
