"""Chat templates: a conversation -> the prompt text the model was trained on.

Rendered the way Hugging Face transformers renders `apply_chat_template`, because a model only
answers well to the exact text its template produces: jinja2's sandboxed environment (a
template comes with a downloaded checkpoint, so it may not reach Python objects), with
`trim_blocks` and `lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps
non-ASCII text as it is, `raise_exception(msg)` for templates that refuse a conversation,
`strftime_now(fmt)`, `{% generation %}` blocks rendered as their body, and the variables
`messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens (`bos_token`,
`eos_token`, ...). The rendered text is tokenized without adding special tokens: the template
writes them itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template does not compile, refuses the conversation (its raise_exception), or the
    conversation is malformed."""


@dataclass
class Message:
    """One turn of a conversation. `content` is None only for an assistant turn that just
    called tools; `tool_calls` are OpenAI's shape with each call's arguments as a mapping (as
    templates write them); `tool_call_id` is a tool result's call."""

    role: str
    content: str | None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """What the template sees: the fields set, as Hugging Face passes a message."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlock, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._compiled = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`; with `add_generation_prompt` it ends where the
        assistant's answer begins."""
        if not messages:
            raise ChatTemplateError("a conversation needs at least one message")
        for m in messages:
            if not (isinstance(m, Message) and isinstance(m.role, str)
                    and (isinstance(m.content, str) or (m.content is None and m.tool_calls))):
                raise ChatTemplateError(f"a message is a role and a text content (or tool calls), got {m!r}")
        variables = {"tools": None, "documents": None, **dict(self.special_tokens), **extra}
        try:
            return self._compiled.render(messages=[m.to_dict() for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """jinja2's own tojson escapes HTML and sorts keys; templates are written for this one."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training
    masks; for serving, only its body matters."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()
