"""Chat templates: a conversation -> the prompt text the model was trained on.

Rendered the way Hugging Face transformers renders `apply_chat_template`, because a model only
answers well to the exact text its template produces: jinja2's sandboxed environment (a
template comes with a downloaded checkpoint, so it may not reach Python objects), with
`trim_blocks` and `lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps
non-ASCII text as it is, `raise_exception(msg)` for templates that refuse a conversation,
`strftime_now(fmt)`, `{% generation %}` blocks rendered as their body, and the variables
`messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens (`bos_token`,
`eos_token`, ...). The rendered text is tokenized without adding special tokens: the template
writes them itself. An assistant turn that only called tools (`content` null, as the openai
client sends it back) is given to the template with the content "", as vLLM gives it: templates
test, split and concatenate the content as a string.

A render is bounded, since the template comes with a checkpoint and the conversation from a
client: it stops with a ChatTemplateError once it has run `time_limit_s` seconds (its Python
frames are traced, so loops that write nothing are stopped too) or written more than `max_chars`
characters, and the operators and calls that make a large string or number in one go (`*`, `+`,
`**`, `%`, a method or filter given a width) are refused when the result would pass that size.
Whatever else fails inside a template is a ChatTemplateError too: the conversation is refused,
the server goes on.
"""
from __future__ import annotations

import json
import math
import operator
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_S = 2.0                 # the longest a render may run
MAX_CHARS = 1 << 24            # the most a render may write, when its user sets no smaller bound
_TEMPLATE_CODE = "<template>"  # the file name jinja2 compiles a template from a string under


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
        """What the template sees: the fields set, as Hugging Face passes a message (a null
        content as "", as vLLM passes it)."""
        out: dict[str, Any] = {"role": self.role, "content": "" if self.content is None else self.content}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to, and the bounds of a
    render (see the module docstring)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    max_chars: int = MAX_CHARS
    time_limit_s: float = RENDER_S

    def __post_init__(self) -> None:
        env = _BoundedEnvironment(self.max_chars, trim_blocks=True, lstrip_blocks=True,
                                  extensions=[_GenerationBlock, loopcontrols])
        env.filters["tojson"] = _tojson
        for name, grows in _GROWING_FILTERS.items():
            env.filters[name] = _sized(env.filters[name], self.max_chars, grows)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._compiled = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template is a checkpoint's file: whatever fails is its error
            raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}: {e}") from None

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
        out: list[str] = []
        size = 0
        watch = _Watch(self.time_limit_s)
        previous = sys.gettrace()
        sys.settrace(watch)
        try:
            for piece in self._compiled.generate(messages=[m.to_dict() for m in messages],
                                                 add_generation_prompt=add_generation_prompt, **variables):
                size += len(piece)
                if size > self.max_chars:
                    raise ChatTemplateError(f"the chat template writes more than {self.max_chars} characters for "
                                            f"this conversation (its limit)")
                out.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template's own failure (a None it adds, ...) refuses this conversation
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:200]}") from None
        finally:
            sys.settrace(previous)
        return "".join(out)


class _Watch:
    """The trace function of a render: its time is checked every 256 calls and every 256 lines
    run in the template's own code (loops that call nothing included); past it the render stops."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.deadline = time.monotonic() + limit_s
        self.events = 0

    def __call__(self, frame, event: str, arg) -> Any:
        self.events += 1
        if not self.events & 255:
            self._check()
        return self._line if frame.f_code.co_filename == _TEMPLATE_CODE else None

    def _line(self, frame, event: str, arg) -> Any:
        self.events += 1
        if not self.events & 255:
            self._check()
        return self._line

    def _check(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template ran longer than {self.limit_s:g} s for this conversation "
                                    f"(its limit)")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the operators and calls that can make a huge value in one step checked
    against `max_chars` before they run."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_chars: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_chars = max_chars

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > self.max_chars:
                    self._too_big(f"{len(seq)} x {n}")
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > self.max_chars:
                self._too_big(f"{len(left)} + {len(right)}")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * math.log2(abs(left)) > 8 * self.max_chars:
            self._too_big(f"{left} ** {right}")
        elif op == "%" and isinstance(left, str):
            _check_widths(left, self.max_chars)
        return _BINOPS[op](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        text = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # (the sandbox wraps str.format)
        if isinstance(text, str):  # a string's method: a width (ljust, center, zfill, ...) or a format's
            for v in (*args, *kwargs.values()):
                if isinstance(v, int) and v > __self.max_chars:
                    __self._too_big(f"a width of {v}")
            if getattr(__obj, "__name__", "") in ("format", "format_map"):
                for spec in re.findall(r"\{[^{}]*?:([^{}]*)\}", text):
                    _check_number(spec, __self.max_chars)
        return super().call(__context, __obj, *args, **kwargs)

    def _too_big(self, what: str) -> None:
        raise ChatTemplateError(f"the chat template makes a value of more than {self.max_chars} characters ({what})")


_BINOPS = {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod}
_PERCENT = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_widths(fmt: str, max_chars: int) -> None:
    """A %-format whose widths or precisions would pad past `max_chars` is refused."""
    for m in _PERCENT.finditer(fmt):
        for part in m.groups():
            if part == "*":
                raise ChatTemplateError("the chat template formats with a width it takes from its arguments")
            if part:
                _check_number(part, max_chars)


def _check_number(text: str, max_chars: int) -> None:
    for m in re.finditer(r"\d+", text):
        if len(m.group()) > 9 or int(m.group()) > max_chars:
            raise ChatTemplateError(f"the chat template formats with a width over {max_chars} characters")


def _replace_grows(value: Any, args: tuple, kwargs: dict, max_chars: int) -> int:
    old = args[0] if args else kwargs.get("old", "")
    new = args[1] if len(args) > 1 else kwargs.get("new", "")
    s, old, new = str(value), str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    return len(s) + hits * max(len(new) - len(old), 0)


def _wordwrap_grows(value: Any, args: tuple, kwargs: dict, max_chars: int) -> int:
    width = args[0] if args else kwargs.get("width", 79)
    wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring")
    s = str(value)
    return len(s) + (len(s) // max(int(width), 1) + 1) * len(wrap or "\n")


def _format_grows(value: Any, args: tuple, kwargs: dict, max_chars: int) -> int:
    _check_widths(str(value), max_chars)
    return 0


# filters that can write far more than they are given, and how much they would write at most
_GROWING_FILTERS = {"center": None, "indent": None, "tojson": None, "format": _format_grows,
                    "replace": _replace_grows, "wordwrap": _wordwrap_grows}


def _sized(fn: Any, max_chars: int, grows: Any) -> Any:
    """`fn` (a filter) refusing a numeric argument (a width, an indent) past `max_chars`, and a
    call whose result `grows` says would pass it."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # (the context or environment first)

    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else ("", ())
        for v in (*rest, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and v > max_chars:
                raise ChatTemplateError(f"the chat template asks a width of {v} (over {max_chars} characters)")
            if isinstance(v, str) and len(v) * max(len(str(value)), 1) > max_chars and fn.__name__ == "do_indent":
                raise ChatTemplateError(f"the chat template indents past {max_chars} characters")
        if grows is not None and grows(value, rest, kwargs, max_chars) > max_chars:
            raise ChatTemplateError(f"the chat template's {fn.__name__} would write more than {max_chars} characters")
        return fn(*args, **kwargs)

    if skip:
        bounded.jinja_pass_arg = fn.jinja_pass_arg  # type: ignore[attr-defined]
    bounded.__name__ = fn.__name__
    return bounded


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
