"""The request bodies of the OpenAI API that kvrt serves, as pydantic models: FastAPI checks a
body's types against them before any handler (and any engine state) sees it."""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


MAX_N = 16           # choices per prompt
MAX_TOP_LOGPROBS = 20
# fields a request may carry that ask nothing of the answer (an end-user id; how to call
# tools in parallel, when tools, refused by name, were given)
HARMLESS = frozenset({"user", "parallel_tool_calls"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingBody(BaseModel):
    """What completions and chat requests share. A field kvrt does not implement is refused by
    name (`unsupported`), never silently ignored, unless it is null or asks nothing of the
    answer (HARMLESS): a 200 always did what the request asked."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # none: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extension
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)  # the engine's seeds are one int64
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    # vLLM's extension, which serving benchmarks send: generate max_tokens whatever the model's EOS
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # vLLM's extension (HF's meaning)
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extensions from here on
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    tools: list | None = None             # refused unless empty (a later feature)
    tool_choice: Union[str, dict, None] = None  # refused unless "none"
    # structured output: OpenAI's response_format, or vLLM's guided_json / guided_regex
    response_format: dict | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None

    @model_validator(mode="after")
    def _bias_range(self) -> "SamplingBody":
        for tok, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {bias:g}")
        return self

    def unsupported(self) -> str | None:
        """The first field this request sets that kvrt does not implement, or None."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in HARMLESS:
                return name
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        return None

    def guided(self) -> tuple[dict | None, str]:
        """The engine's guided spec ({"kind", "spec"}: runtime/client/api.py's Generation) that
        the request asks for, and the field that asked; ValueError (naming that field) when
        the field is malformed. A text response_format asks for nothing."""
        asked = [(n, v) for n, v in (("response_format", self.response_format), ("guided_json", self.guided_json),
                                     ("guided_regex", self.guided_regex)) if v is not None
                 and v != {"type": "text"}]
        if not asked:
            return None, ""
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]}: give one of response_format, guided_json and guided_regex")
        name, value = asked[0]
        if name == "guided_regex":
            return {"kind": "regex", "spec": value}, name
        if name == "guided_json":
            return {"kind": "json_schema", "spec": value if isinstance(value, str) else json.dumps(value)}, name
        kind = value.get("type")
        if kind == "json_object":
            return {"kind": "json_object", "spec": ""}, name
        if kind == "json_schema":
            schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) \
                else None
            if not isinstance(schema, dict):
                raise ValueError('response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return {"kind": "json_schema", "spec": json.dumps(schema)}, name
        raise ValueError(f"response_format: type must be text, json_object or json_schema, got {str(kind)[:40]!r}")

    def wants_logprobs(self) -> bool:
        return False

    def top_logprobs_count(self) -> int:
        return 0

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # the chosen token's log-probability and this many alternatives
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_logprobs_count(self) -> int:
        return self.logprobs or 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        """The content as one string (a list of text parts joined, as OpenAI reads it)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_role(self) -> str:
        """The role the chat template sees: `developer` is OpenAI's newer name for `system`."""
        return "system" if self.role == "developer" else self.role


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def top_logprobs_count(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template. Special
    tokens are added to a prompt and not to a conversation (its template writes them) unless
    `add_special_tokens` says otherwise."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
