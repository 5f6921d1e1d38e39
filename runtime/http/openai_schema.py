"""The request bodies of the OpenAI API that kvrt serves, as pydantic models: FastAPI checks a
body's types against them before any handler (and any engine state) sees it."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvrt.runtime.client.api import cache_salt_problem


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
    response_format: dict | None = None    # refused unless {"type": "text"}
    # vLLM's: the request shares cached blocks only with requests of the same salt (one per tenant)
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and (problem := cache_salt_problem(v) or ("" if v else "cache_salt must not be empty")):
            raise ValueError(problem)
        return v

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
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format"
        return None

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
