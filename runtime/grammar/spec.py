"""A request's `guided` field, checked for its shape only: what the engine and the HTTP server
may look at without parsing a schema or building an automaton.

Why so little here: a spec's cost is only known once it is parsed and its automaton estimated,
and both happen in a compile process that can be killed (runtime/grammar/pool.py). A front door
that parsed or compiled a spec itself (the HTTP server once built a regex's automaton on its
event loop) could be frozen by a 30-byte regex, so the front doors check the shape and the size,
and every other refusal comes back from the compile process as the request's 400.
"""
from __future__ import annotations

from kvrt.ipc import json_bounds

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")
JSON_KINDS = ("json_schema", "choice", "tool_call")  # whose spec is JSON text
MAX_SPEC_BYTES = 64 << 10  # a spec larger than this is no structured-output spec


class GrammarError(ValueError):
    """A guided spec that cannot be followed. `refused`: the spec itself is at fault (a keyword
    kvrt does not enforce, a limit it passes), so the request is a bad one; otherwise the node
    failed to compile it (the compile process died for another reason, or none was free in
    time)."""

    def __init__(self, message: str, refused: bool = True):
        super().__init__(message)
        self.refused = refused


def guided_problem(guided: object) -> str:
    """The first problem with a request's `guided` field's shape, or "" (None asks for nothing)."""
    if guided is None:
        return ""
    if not isinstance(guided, dict) or set(guided) - {"kind", "spec"} or "kind" not in guided:
        return f'guided must be {{"kind": one of {", ".join(KINDS)}, "spec": a string}} or null'
    kind, spec = guided.get("kind"), guided.get("spec", "")
    if kind not in KINDS:
        return f"guided kind must be one of {', '.join(KINDS)}, got {str(kind)[:40]!r}"
    if not isinstance(spec, str):
        return "guided spec must be a string (a JSON schema as JSON text, a regex, a grammar, or a JSON list)"
    if len(spec.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
        return f"guided spec is longer than {MAX_SPEC_BYTES} bytes"
    if kind != "json_object" and not spec:
        return f"guided {kind} is empty"
    if kind in JSON_KINDS:  # its depth bounded before any parser (ours or outlines-core's) reads it
        return json_bounds.problem(spec, MAX_SPEC_BYTES, what=f"guided {kind}")
    return ""


def describe(guided: dict) -> str:
    """A short name of a spec for messages: its kind and the start of its text."""
    spec = guided.get("spec", "")
    return guided["kind"] + (f" {spec[:60]!r}" + ("..." if len(spec) > 60 else "") if spec else "")
