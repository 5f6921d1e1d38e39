"""The request bodies of the OpenAI API that kvrt serves, as pydantic models: FastAPI checks a
body's types against them before any handler (and any engine state) sees it."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.types import FailFast

from kvrt.ipc import json_bounds
from kvrt.runtime.client.api import cache_salt_problem
from kvrt.runtime.http.vllm_fields import refusal


T = TypeVar("T")

# A list in a body, validated up to its first bad element: pydantic otherwise builds an error per
# bad element, and a 5 MiB list of them (a body under the limit) held hundreds of MiB of errors.
class _FailFast(FailFast):
    """FailFast that a Union can hold (it puts its members in a set)."""

    def __hash__(self) -> int:
        return hash(type(self))


Each = Annotated[list[T], _FailFast()]

MAX_N = 16           # choices per prompt
MAX_TOP_LOGPROBS = 20


# vLLM's structured_outputs keys that ask for a grammar, and the guided kind each is
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# its keys that ask nothing at these values
STRUCTURED_HARMLESS = {"disable_fallback": False, "disable_any_whitespace": False,
                       "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}


def _structured_outputs(value: dict) -> dict:
    """vLLM's `structured_outputs` ({"json": ..., "regex": ..., "choice": [...], "grammar": ...,
    "json_object": true}) as the engine's guided spec (ValueError naming the key)."""
    asked = {k: v for k, v in value.items() if v is not None and not (k in STRUCTURED_HARMLESS
                                                                      and v == STRUCTURED_HARMLESS[k])}
    for k in asked:
        if k not in STRUCTURED_KINDS:
            raise ValueError(f"structured_outputs: {k!r} is not supported (kvrt takes "
                             f"{', '.join(STRUCTURED_KINDS)})")
    if len(asked) != 1:
        raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KINDS)}")
    (k, v), = asked.items()
    kind = STRUCTURED_KINDS[k]
    if kind == "json_object":
        if v is not True:
            raise ValueError("structured_outputs: json_object must be true")
        return {"kind": kind, "spec": ""}
    if kind == "json_schema":
        if not isinstance(v, (dict, str)):
            raise ValueError("structured_outputs: json is a JSON schema (an object, or its JSON text)")
        return {"kind": kind, "spec": v if isinstance(v, str) else json.dumps(v)}
    if kind == "choice":
        if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
            raise ValueError("structured_outputs: choice is a list of strings")
        return {"kind": kind, "spec": json.dumps(v)}
    if not isinstance(v, str):
        raise ValueError(f"structured_outputs: {k} is a string")
    return {"kind": kind, "spec": v}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class SamplingBody(BaseModel):
    """What completions and chat requests share. A field kvrt does not implement is refused by
    name (`unsupported`), never silently ignored, unless it is null or asks nothing of the
    answer at its value (runtime/http/vllm_fields.py): a 200 always did what the request asked."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # none: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extension
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)  # the engine's seeds are one int64
    stop: Union[str, Each[str], None] = None
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
    stop_token_ids: Each[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and rank, and this many alternatives at its position
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None             # chat's (ChatRequest); elsewhere refused unless empty
    tool_choice: Union[str, dict, None] = None  # chat's; elsewhere refused unless "none"
    # structured output: OpenAI's response_format, vLLM's guided_* fields or its structured_outputs
    response_format: dict | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: Each[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
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
        problem = self.refusal()
        return problem[0] if problem else None

    def refusal(self) -> tuple[str, str] | None:
        """(the first field this request sets that kvrt does not do at its value, why), or None."""
        for name, value in (self.model_extra or {}).items():
            if why := refusal(name, value):
                return name, why
        if name := self._unsupported_tools():
            return name, f"{name} is not supported by this server"
        return None

    def continuous_usage(self) -> bool:
        """vLLM's stream_options: every chunk carries the usage so far (with include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage \
            and self.stream_options.continuous_usage_stats

    def _unsupported_tools(self) -> str | None:
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        return None

    def guided(self) -> tuple[dict | None, str]:
        """The engine's guided spec ({"kind", "spec"}: runtime/client/api.py's Generation) that
        the request asks for, and the field that asked; ValueError (naming that field) when
        the field is malformed. A text response_format asks for nothing. Only the shape is
        looked at: the spec is parsed, and refused naming what in it, by the node's compile
        processes (runtime/grammar/), never on the server's event loop."""
        asked = [(n, v) for n, v in (("response_format", self.response_format), ("guided_json", self.guided_json),
                                     ("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
                                     ("guided_grammar", self.guided_grammar),
                                     ("structured_outputs", self.structured_outputs)) if v is not None
                 and v != {"type": "text"}]
        if not asked:
            return None, ""
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]}: give one of response_format, guided_json, guided_regex, guided_choice, "
                             f"guided_grammar and structured_outputs")
        name, value = asked[0]
        if name == "structured_outputs":
            return _structured_outputs(value), name
        if name == "guided_regex":
            return {"kind": "regex", "spec": value}, name
        if name == "guided_choice":
            return {"kind": "choice", "spec": json.dumps(value)}, name
        if name == "guided_grammar":
            return {"kind": "grammar", "spec": value}, name
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

    def prompt_logprobs_count(self) -> int | None:
        """The alternatives the engine scores the prompt with; None: the prompt is not scored."""
        return self.prompt_logprobs

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _all_of(items: list, kind: type) -> bool:
    return all(type(x) is kind for x in items)  # (exactly: a bool is no token id)


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # the chosen token's log-probability and this many alternatives
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) around a text prompt

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> Union[str, list[str], list[int], list[list[int]]]:
        """One pass over the prompt and one error at most. Why: pydantic's union validated a list
        against each of its list members, element by element, so a long list of the wrong type
        built an error per element per member (a 5 MiB body of floats: 3.9 million errors, half a
        GiB and seconds of CPU in the HTTP server), and a valid list of token ids cost several
        times its size."""
        if isinstance(v, str) or isinstance(v, list) and (
                _all_of(v, str) or _all_of(v, int) or all(type(x) is list and _all_of(x, int) for x in v)):
            return v
        raise ValueError("a prompt is a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_logprobs_count(self) -> int:
        return self.logprobs or 0

    def prompt_logprobs_count(self) -> int | None:
        """`echo` with `logprobs` k shows the prompt's logprobs too, with k alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(BaseModel):
    """A tool's function: its `parameters` are a JSON schema of its arguments (an object)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the answer must call."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as the API gave it


class CalledTool(BaseModel):
    """A call an earlier assistant turn made."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Each[TextPart], None] = None  # none: an assistant turn that only called tools
    tool_calls: Each[CalledTool] | None = None  # an assistant's
    tool_call_id: str | None = None             # a tool result's: the call it answers
    name: str | None = None
    reasoning_content: str | None = None        # an assistant's thinking, for templates that show it

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message calls tools, not a {self.role} one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: a {self.role} message needs a content")
        for c in self.tool_calls or []:
            try:
                args = json_bounds.loads(c.function.arguments, None)
            except json_bounds.JsonBoundsError as e:
                raise ValueError(f"tool_calls: the arguments of {c.function.name!r}: {e}") from None
            except ValueError:
                raise ValueError(f"tool_calls: the arguments of {c.function.name!r} are not JSON") from None
            if not isinstance(args, dict):
                raise ValueError(f"tool_calls: the arguments of {c.function.name!r} are not a JSON object")
        return self

    def text(self) -> str | None:
        """The content as one string (a list of text parts joined, as OpenAI reads it)."""
        if self.content is None:
            return None
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_calls(self) -> list[dict] | None:
        """The calls as a chat template reads them: arguments as a mapping (Hugging Face's and
        vLLM's way), since templates write them with `tojson`."""
        if self.tool_calls is None:
            return None
        return [{**({"id": c.id} if c.id is not None else {}), "type": "function",
                 "function": {"name": c.function.name, "arguments": json_bounds.loads(c.function.arguments, None)}}
                for c in self.tool_calls]

    def template_role(self) -> str:
        """The role the chat template sees: `developer` is OpenAI's newer name for `system`."""
        return "system" if self.role == "developer" else self.role


# what the server itself gives a chat template, which chat_template_kwargs may not replace
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def template_kwargs_problem(kwargs: dict | None) -> str | None:
    taken = sorted(TEMPLATE_RESERVED & set(kwargs or {}))
    return f"chat_template_kwargs: {taken[0]} is the server's to set" if taken else None


class ChatRequest(SamplingBody):
    messages: Each[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Each[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: more template variables
    # vLLM's: the template's opening of the assistant turn, and the tokenizer's special tokens
    # around the rendered text (the template writes its own: off by default)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # OpenAI's; a variable of the chat template, as vLLM hands it over (templates that read it,
    # such as gpt-oss's, use it; others ignore it, as the model would)
    reasoning_effort: str | None = Field(default=None, max_length=32)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def template_variables(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort when the request sets it (unless the kwargs do)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def tools_problem(self) -> tuple[str, str] | None:
        """(the field, what is wrong) when the tools, the choice among them or the template's
        variables do not fit together."""
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return "tools", "tools: two tools have the same name"
        if self.tool_choice not in (None, "none") and not names:
            return "tool_choice", "tool_choice: a choice of tools needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            return "tool_choice", f"tool_choice: {self.tool_choice.function.name!r} is not one of the tools"
        if problem := template_kwargs_problem(self.chat_template_kwargs):
            return "chat_template_kwargs", problem
        return None

    def _unsupported_tools(self) -> str | None:
        return None  # chat's own

    def choice(self) -> str:
        """The tool choice in effect: "none", "auto", "required" or the named function's "function"."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else "function"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (OpenAI's shape, as Hugging Face passes them)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

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
    messages: Each[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Each[Tool] | None = None            # rendered with messages, as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if problem := template_kwargs_problem(self.chat_template_kwargs):
            raise ValueError(problem)
        return self

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Each[int]
