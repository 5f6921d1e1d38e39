"""A guided spec to its regex, and the regex to an outlines-core Index over a vocabulary: the work
a compile process does (runtime/grammar/worker.py), importable so tests and benchmarks run it in
process.

Why every kind becomes a regex first: outlines-core's Index is a regex's automaton precomputed
over the vocabulary (for each state, which tokens are allowed and where each leads), built in
Rust without torch, so a step's mask is one table read per guided row. The regex is written by
kvrt (runtime/grammar/rx.py) with its size known, so `limits.py` refuses an automaton too big to
build before outlines-core starts on it.

The EOS: the index allows the request's EOS id in final states only (and nothing else there
when the grammar cannot go on), so the model ends the answer exactly when the grammar is
complete; other special tokens are no text and never allowed (runtime/engine/token_bytes.py).
"""
from __future__ import annotations

import json
from typing import Any

from kvrt.runtime.grammar.ebnf import GrammarRefused, grammar_rx
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.pattern import PatternError, to_rx
from kvrt.runtime.grammar.rx import Budget, Rx, TooBig, alt, lit
from kvrt.runtime.grammar.schema import Refused, schema_regex
from kvrt.runtime.grammar.spec import GrammarError, describe
from kvrt.runtime.grammar.tool_call import ToolSchemaError, forced_call_rx, read_tool_call_spec

JSON_OBJECT = {"type": "object"}
MAX_CHOICES = 4096


def spec_rx(guided: dict, budget: Budget) -> Rx:
    """The regex of a guided spec (GrammarError naming what in it cannot be followed)."""
    kind, spec = guided["kind"], guided.get("spec", "")
    try:
        if kind == "json_object":
            return schema_regex(JSON_OBJECT, budget)
        if kind == "json_schema":
            return schema_regex(_json(spec, "json_schema"), budget)
        if kind == "regex":
            got = to_rx(spec, budget, in_json=False, search=True)
            if got is None:
                raise GrammarError("the regex matches nothing")
            return got
        if kind == "choice":
            choices = _json(spec, "choice")
            if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES \
                    or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError(f"guided choice is a list of 1 to {MAX_CHOICES} non-empty strings")
            return budget.check(alt(*[lit(c) for c in choices]))
        if kind == "grammar":
            return grammar_rx(spec, budget)
        if kind == "tool_call":
            return forced_call_rx(*read_tool_call_spec(spec), budget)
    except (Refused, PatternError, GrammarRefused, ToolSchemaError) as e:
        raise GrammarError(str(e)) from None
    except TooBig as e:
        raise GrammarError(f"the grammar is too big to compile: {e}") from None
    except RecursionError:
        raise GrammarError("the spec nests too deep") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # a keyword of the wrong type deep in a schema ({"minProperties": "x"}): the spec's fault
        raise GrammarError(f"the spec is malformed ({type(e).__name__}: {str(e)[:120]})") from None
    raise GrammarError(f"unknown guided kind {kind!r}")


def _json(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"guided {kind} is not JSON: {e}") from None


def build_index(guided: dict, vocabulary: Any, vocab_size: int, limits: Limits) -> tuple[Any, Rx]:
    """The Index of `guided` over `vocabulary` (an outlines-core Vocabulary of `vocab_size`
    token ids), and its regex; GrammarError names the spec and what refused it."""
    from outlines_core import Index

    try:
        rx = spec_rx(guided, limits.budget(vocab_size))
    except GrammarError as e:
        raise GrammarError(f"guided {describe(guided)}: {e}") from None
    if problem := limits.problem(rx, vocab_size):
        raise GrammarError(f"guided {describe(guided)}: {problem}")
    try:
        return Index(rx.text, vocabulary), rx
    except (ValueError, TypeError) as e:
        raise GrammarError(f"cannot compile guided {describe(guided)}: {e}") from None


def vocabulary(token_bytes: dict[int, bytes], eos: int) -> Any:
    """An outlines-core Vocabulary of the text tokens (`token_bytes`: id -> bytes) with `eos`."""
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = {}
    for tid, b in token_bytes.items():
        if tid != eos and b:
            by_bytes.setdefault(b, []).append(tid)
    return Vocabulary(eos, by_bytes)
