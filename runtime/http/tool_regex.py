"""The regular expression a forced tool call is decoded under (`tool_choice` "required" or a
named function): exactly one call, in the markup of the server's tool-call format, of one of
the allowed tools, its arguments valid under that tool's `parameters` JSON schema.

Why the model's own markup rather than a bare JSON object: the answer then reads like the
model's natural calls, which the same parser (runtime/http/tool_calls.py) turns into
`tool_calls`, streamed or not, and a model trained on the format stays on familiar ground.
The arguments' part comes from outlines_core, whose JSON-schema compiler guided decoding shares.
"""
from __future__ import annotations

import json

from outlines_core.json_schema import build_regex_from_schema

from kvrt.runtime.http.tool_calls import HERMES, HERMES_CLOSE, HERMES_OPEN, LLAMA3_JSON

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_SPECIAL = set("\\.^$|?*+()[]{}")


class ToolSchemaError(ValueError):
    """A tool's parameters are not a JSON schema a call can be decoded under."""


def _literal(text: str) -> str:
    """`text` as a regex matching it alone (only the metacharacters escaped, so that any regex
    dialect reads it the same)."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def arguments_regex(name: str, parameters: dict | None) -> str:
    """A regex for the arguments of tool `name`: JSON objects valid under `parameters`."""
    schema = parameters if parameters else EMPTY_PARAMETERS
    try:
        return build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError) as e:
        raise ToolSchemaError(f"the parameters of tool {name!r} cannot be decoded under: {e}") from None


def forced_call_regex(fmt: str, tools: list[tuple[str, dict | None]]) -> str:
    """One call of one of `tools` ((name, parameters schema) pairs), in format `fmt`."""
    if not tools:
        raise ValueError("a forced call needs at least one tool")
    if fmt not in (HERMES, LLAMA3_JSON):
        raise ValueError(f"unknown tool-call format {fmt!r}")
    key = "arguments" if fmt == HERMES else "parameters"
    calls = []
    for name, parameters in tools:
        head = _literal('{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{key}": ')
        calls.append(head + "(" + arguments_regex(name, parameters) + ")" + _literal("}"))
    body = "(" + "|".join(calls) + ")"
    if fmt == HERMES:
        return _literal(HERMES_OPEN + "\n") + body + _literal("\n" + HERMES_CLOSE)
    return body
