r"""JSON from outside, bounded before it is parsed: its size and how deeply it nests.

Why before: Python's json parser (and every recursive one: pydantic's, jinja's, the code that
walks the result) takes one call per level of nesting, so a text of a few thousand `[` raises
RecursionError from inside the parser, an exception no `except ValueError` expects; one such
request, whatever port it came in on, ended the process that parsed it. Counting the depth
first turns it into a clear refusal, and what passes nests no deeper than MAX_DEPTH, so the
code that walks it later stays far from any recursion limit.

How the depth is counted without parsing: only `[` and `{` outside strings open a level. Inside
a string, a backslash escapes the next byte, so every escape pair is blanked first (`\\`, then
`\"`, left to right as a parser reads them), after which each quote left opens or closes a
string; the brackets outside strings are then counted a MiB at a time with numpy (a few ms a MiB
of CPU; a deep text stops the count as soon as a chunk shows it). Invalid JSON can only be
miscounted past the point where a parser would stop at an error, so the count is never below
the depth a parser would reach. A text with no more brackets than the limit cannot nest deeper,
and is not scanned at all.

Where it is used: every place that parses JSON from a client or a peer (the HTTP ports' bodies,
a guided JSON schema, tool-call arguments, the router's view of a body and of a backend's
events) goes through `problem` or `loads`.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

MAX_DEPTH = 64  # levels of arrays and objects: far past any request or schema a model serves
_CHUNK = 1 << 20
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))
_QUOTE = ord('"')


class JsonBoundsError(ValueError):
    """A JSON text over its size or depth limit (a ValueError, as a parse error is)."""


def as_bytes(text: str | bytes | bytearray | memoryview) -> bytes:
    """The UTF-8 bytes of `text` (lone surrogates kept: they are no bracket or quote)."""
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def depth(text: str | bytes, stop_above: int = MAX_DEPTH) -> int:
    """How deeply `text` nests arrays and objects (0: a scalar), or a number above `stop_above`
    as soon as it is known to be deeper (the rest is not counted)."""
    data = as_bytes(text).replace(b"\\\\", b"__").replace(b'\\"', b"__")  # escape pairs blanked
    level, deepest, in_string = 0, 0, 0
    for start in range(0, len(data), _CHUNK):
        chunk = np.frombuffer(data, np.uint8, min(_CHUNK, len(data) - start), start)
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.int32)  # odd inside a string (with in_string)
        steps = ((chunk == _OPEN[0]) | (chunk == _OPEN[1])).view(np.int8) \
            - ((chunk == _CLOSE[0]) | (chunk == _CLOSE[1])).view(np.int8)
        steps[((quotes + in_string) & 1) == 1] = 0
        levels = np.cumsum(steps, dtype=np.int64)
        deepest, level = max(deepest, level + int(levels.max())), level + int(levels[-1])
        in_string = (in_string + int(quotes[-1])) & 1
        if deepest > stop_above:
            break
    return deepest


def problem(text: str | bytes, max_bytes: int | None, max_depth: int = MAX_DEPTH, what: str = "the JSON text") -> str:
    """What makes `text` too big or too deep to parse ("" when it is within both limits;
    `max_bytes` None: its size was bounded already, as a field of a bounded body)."""
    data = as_bytes(text)
    if max_bytes is not None and len(data) > max_bytes:
        return f"{what} is {len(data)} bytes long; at most {max_bytes} are read"
    if data.count(b"[") + data.count(b"{") > max_depth and depth(data, max_depth) > max_depth:
        return f"{what} nests arrays and objects more than {max_depth} levels deep"
    return ""


def loads(text: str | bytes, max_bytes: int | None, max_depth: int = MAX_DEPTH, what: str = "the JSON text") -> Any:
    """`json.loads(text)` once `text` is within both limits; JsonBoundsError (a ValueError)
    naming the limit otherwise, and the parser's own ValueError for a text that is not JSON."""
    if why := problem(text, max_bytes, max_depth, what):
        raise JsonBoundsError(why)
    return json.loads(text)
