"""The regular expression a forced tool call is decoded under (`tool_choice` "required" or a
named function): exactly one call, in the markup of the server's tool-call format, of one of
the allowed tools, its arguments valid under that tool's `parameters` JSON schema.

Why the model's own markup rather than a bare JSON object: the answer then reads like the
model's natural calls, which the same parser (runtime/http/tool_calls.py) turns into
`tool_calls`, streamed or not, and a model trained on the format stays on familiar ground.
The arguments' part comes from runtime/grammar/schema.py, as a json_schema's does, so a tool's
`pattern` or bounds are enforced or refused by name like any schema's; and it is built in the
compile process (the HTTP server only sends the tools: kind "tool_call").
"""
from __future__ import annotations

import json

from kvrt.runtime.grammar.rx import Budget, Rx, alt, lit, seq
from kvrt.runtime.grammar.schema import Refused, schema_regex
from kvrt.runtime.http.tool_calls import HERMES, HERMES_CLOSE, HERMES_OPEN, LLAMA3_JSON

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
UNBOUNDED = Budget(1 << 62)


class ToolSchemaError(ValueError):
    """A tool's parameters are not a JSON schema a call can be decoded under."""


def arguments_rx(name: str, parameters: dict | None, budget: Budget) -> Rx:
    """JSON objects valid under the `parameters` of tool `name`."""
    try:
        return schema_regex(parameters if parameters else EMPTY_PARAMETERS, budget)
    except Refused as e:
        raise ToolSchemaError(f"the parameters of tool {name!r} cannot be decoded under: {e}") from None


def forced_call_rx(fmt: str, tools: list[tuple[str, dict | None]], budget: Budget) -> Rx:
    """One call of one of `tools` ((name, parameters schema) pairs), in format `fmt`."""
    if not tools:
        raise ToolSchemaError("a forced call needs at least one tool")
    if fmt not in (HERMES, LLAMA3_JSON):
        raise ToolSchemaError(f"unknown tool-call format {fmt!r}")
    key = "arguments" if fmt == HERMES else "parameters"
    calls = [seq(lit('{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{key}": '),
                 arguments_rx(name, parameters, budget), lit("}")) for name, parameters in tools]
    body = budget.check(alt(*calls))
    if fmt == HERMES:
        return seq(lit(HERMES_OPEN + "\n"), body, lit("\n" + HERMES_CLOSE))
    return body


def forced_call_regex(fmt: str, tools: list[tuple[str, dict | None]]) -> str:
    """`forced_call_rx`'s text, unbounded (for tests and readers of the regex)."""
    return forced_call_rx(fmt, tools, UNBOUNDED).text


def tool_call_spec(fmt: str, tools: list[tuple[str, dict | None]]) -> str:
    """The `spec` of a guided "tool_call" request: the format and the allowed tools, as JSON."""
    return json.dumps({"format": fmt, "tools": [[name, parameters] for name, parameters in tools]})


def read_tool_call_spec(spec: str) -> tuple[str, list[tuple[str, dict | None]]]:
    """`tool_call_spec`'s parts back (ToolSchemaError when malformed)."""
    try:
        got = json.loads(spec)
        fmt, tools = got["format"], [(str(n), p) for n, p in got["tools"]]
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise ToolSchemaError(f"guided tool_call spec is not {{\"format\", \"tools\"}}: {str(e)[:100]}") from None
    if not all(p is None or isinstance(p, dict) for _, p in tools):
        raise ToolSchemaError("a tool's parameters are a JSON schema object")
    return fmt, tools
