"""Tool calls in a model's answer, read as vLLM's `--tool-call-parser` formats write them:

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  any number of them, with text around them;
- `llama3_json` (Llama 3.1+): the answer is `{"name": "f", "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several joined by `;`; text after the calls
  stays content, an answer that does not open with a call is all content.

Why one incremental parser for both the streamed and the whole answer: what it emits depends
only on the text seen so far, never on where the pieces were cut, so a streamed answer's deltas
join into exactly the message the same text gives at once. A call counts from its header on
(`{"name": "<string>", "arguments": ` and the arguments' `{`); until then its text is held back,
and a header that cannot be completed is content, markup included (a malformed call is never an
error). From the header on, the arguments stream as the model writes them (their raw JSON text,
so `function.arguments` is a JSON string) up to the `}` that closes them; what follows up to the
closing tag is markup. Whitespace next to a call is markup too.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable, Union

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
PARSERS = (HERMES, LLAMA3_JSON)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HEADER_CAP = 512  # characters a call's header may take before it is read as text
_WS = " \t\r\n"
_NEED, _BAD = "need", "bad"


@dataclass
class CallDelta:
    """A piece of tool call `index`: its first piece has the id and name, every piece may add
    to the arguments' text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = Union[str, CallDelta]  # content text, or a piece of a call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def default_parser(chat_template: str | None) -> str | None:
    """The format a chat template's tool prompt asks for, when it names one."""
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return HERMES
    if PYTHON_TAG in chat_template or '"parameters": ' in chat_template:
        return LLAMA3_JSON
    return None


def _header(text: str, keys: tuple[str, ...], tag: str = "") -> tuple[str, int] | str:
    """Read `[tag] {"name": "<name>", "<key>": ` up to the `{` that opens the arguments:
    (name, index of that `{`), _NEED if `text` may still become one, _BAD if it cannot."""
    n, p = len(text), 0

    def ws(p: int) -> int:
        while p < n and text[p] in _WS:
            p += 1
        return p

    def lit(p: int, options: tuple[str, ...]) -> int | str:
        rest = text[p:]
        for o in options:
            if rest.startswith(o):
                return p + len(o)
        return _NEED if any(o.startswith(rest) for o in options) else _BAD

    p = ws(p)
    if tag:
        rest = text[p:]
        if rest.startswith(tag):
            p = ws(p + len(tag))
        elif tag.startswith(rest):
            return _NEED
    for want in (("{",), ('"name"',), (":",)):
        p = lit(ws(p), want)
        if isinstance(p, str):
            return p
    p = ws(p)
    if p == n:
        return _NEED
    if text[p] != '"':
        return _BAD
    end, esc = p + 1, False
    while end < n and (esc or text[end] != '"'):
        esc = not esc and text[end] == "\\"
        end += 1
    if end == n:
        return _NEED
    try:
        name = json.loads(text[p:end + 1])
    except ValueError:
        return _BAD
    if not name:
        return _BAD
    p = end + 1
    for want in ((",",), tuple(f'"{k}"' for k in keys), (":",), ("{",)):
        p = lit(ws(p), want)
        if isinstance(p, str):
            return p
    return name, p - 1


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """One answer's text, fed in pieces of any size, as content pieces and call deltas."""

    def __init__(self, fmt: str, new_id: Callable[[], str] = new_call_id) -> None:
        if fmt not in PARSERS:
            raise ValueError(f"unknown tool-call parser {fmt!r} (one of {', '.join(PARSERS)})")
        self.fmt = fmt
        self.new_id = new_id
        self.buf = ""
        self.ws = ""  # trailing whitespace of the content, shown once more content follows
        self.state = "text" if fmt == HERMES else "header"
        self.calls = 0
        self.depth, self.in_str, self.esc = 0, False, False
        self.out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while self._step():
            pass
        out, self.out = self.out, []
        return out

    def finish(self) -> list[Piece]:
        """What the end of the answer releases: a header that never completed, as content."""
        self.feed("")
        if self.state == "header":
            self._content((HERMES_OPEN if self.fmt == HERMES else "") + self.buf)
        elif self.state in ("text", "plain"):
            self._content(self.buf)
        self.buf = ""
        if self.ws:
            self.out.append(self.ws)
            self.ws = ""
        out, self.out = self.out, []
        return out

    def _content(self, text: str) -> None:
        text = self.ws + text
        kept = text.rstrip(_WS)
        self.ws = text[len(kept):]
        if kept:
            self.out.append(kept)

    def _step(self) -> bool:
        """One move of the state machine; False when it needs more text."""
        state, buf = self.state, self.buf
        if state == "plain":  # llama3_json past its calls: the rest is content
            self._content(buf)
            self.buf = ""
            return False
        if state == "text":
            i = buf.find(HERMES_OPEN)
            if i < 0:
                k = held_back(buf, HERMES_OPEN)
                self._content(buf[:len(buf) - k])
                self.buf = buf[len(buf) - k:]
                return False
            self._content(buf[:i])
            self.buf, self.state = buf[i + len(HERMES_OPEN):], "header"
            return True
        if state == "header":
            hermes = self.fmt == HERMES
            got = _header(buf[:HEADER_CAP], ("arguments",) if hermes else ("parameters", "arguments"),
                          "" if hermes or self.calls else PYTHON_TAG)
            if got == _NEED and len(buf) < HEADER_CAP:
                return False
            if isinstance(got, str):  # not a call: its text is content
                if hermes:
                    self._content(HERMES_OPEN)
                    self.state = "text"
                else:
                    self.state = "plain"
                return True
            name, at = got
            self.ws = ""
            self.out.append(CallDelta(self.calls, "", self.new_id(), name))
            self.buf, self.state = buf[at:], "args"
            self.depth, self.in_str, self.esc = 0, False, False
            return True
        if state == "args":
            end = self._scan(buf)
            if end:
                self.out.append(CallDelta(self.calls, buf[:end]))
            self.buf = buf[end:]
            if self.depth:
                return False
            self.calls += 1
            self.state = "tail"
            return True
        if state == "tail" and self.fmt == HERMES:  # up to the closing tag: markup
            i = buf.find(HERMES_CLOSE)
            if i < 0:
                self.buf = buf[len(buf) - held_back(buf, HERMES_CLOSE):]
                return False
            self.buf, self.state = buf[i + len(HERMES_CLOSE):], "after"
            return True
        if state == "after":  # hermes: whitespace after a call
            rest = buf.lstrip(_WS)
            self.buf = rest
            if rest:
                self.state = "text"
            return bool(rest)
        # llama3_json after a call's arguments: `}`, then `;` or `{` for another call, else text
        rest = buf.lstrip(_WS)
        self.buf = rest
        if not rest:
            return False
        if state == "tail":
            if rest[0] == "}":
                self.buf, self.state = rest[1:], "sep"
            else:
                self.state = "plain"
            return True
        if rest[0] == ";":
            self.buf, self.state = rest[1:], "header"
        else:
            self.state = "header" if rest[0] == "{" else "plain"
        return True

    def _scan(self, text: str) -> int:
        """Follow the arguments' JSON up to the `}` that closes them: the characters taken."""
        depth, in_str, esc = self.depth, self.in_str, self.esc
        i = 0
        for i, ch in enumerate(text, 1):
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    break
        self.depth, self.in_str, self.esc = depth, in_str, esc
        return i


def parse_tool_calls(fmt: str, text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content (the text outside calls) and its calls."""
    p = ToolCallParser(fmt, new_id)
    return join_pieces(p.feed(text) + p.finish())


def join_pieces(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """Content pieces and call deltas, joined as a client joins a stream's."""
    content, calls = [], []
    for piece in pieces:
        if isinstance(piece, str):
            content.append(piece)
        elif piece.name is not None:
            calls.append(ToolCall(piece.id or "", piece.name, piece.arguments))
        else:
            calls[piece.index].arguments += piece.arguments
    return "".join(content), calls
