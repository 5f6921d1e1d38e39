"""The request bodies of the OpenAI API that kvrt serves, as pydantic models: FastAPI checks a
body's types against them before any handler (and any engine state) sees it."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """What completions and chat requests share. Unknown fields are ignored, as OpenAI-compatible
    servers do, so that clients sending newer options still work."""

    model_config = ConfigDict(extra="ignore")

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
    n: int = Field(default=1, ge=1, le=1)
    # vLLM's extension, which serving benchmarks send: generate max_tokens whatever the model's EOS
    ignore_eos: bool = False

    def wants_logprobs(self) -> bool:
        return False

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # only the chosen token's log-probability is known: 0 asks for it, without alternatives
    logprobs: int | None = Field(default=None, ge=0, le=0)
    echo: Literal[False] = False

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        """The content as one string (a list of text parts joined, as OpenAI reads it)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=0)

    def wants_logprobs(self) -> bool:
        return self.logprobs


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
