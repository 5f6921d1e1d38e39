"""Guided decoding's grammars: a request's guided spec checked at intake, and compiled into an
outlines-core Index over the served tokenizer's vocabulary, once per spec, off the engine loop.

Why outlines-core: its Index is a regex's automaton precomputed over the whole vocabulary (for
each state, which tokens are allowed and where each leads), built in Rust without torch, so a
step's mask is one table read per guided row. JSON schemas become regexes first
(`build_regex_from_schema`), as vLLM's outlines backend does. JSON mode is an object whose
values are scalars, or objects and arrays of scalars (`json_object_regex`): outlines-core's
regex for the schema {"type": "object"} nests three levels deep, and its automaton alone took
8.6 s to build over a 256-token vocabulary here, against 0.35 s for this one.

Why a thread: compiling an index walks the automaton against every token (about 0.3 s for a
typical schema over a 151k vocabulary, see `kvrt bench sampler`) and outlines-core releases the
GIL meanwhile, so one compile thread keeps the loop's steps and heartbeats on time; a request
waits for its grammar (runtime/engine/client_api.py), never the loop. Compiled indexes are
cached by (spec, EOS id): agents send the same schema over and over.

The EOS: the index allows the request's EOS id in final states only (and nothing else there
when the grammar cannot go on), so the model ends the answer exactly when the grammar is
complete; other special tokens are no text and never allowed (runtime/engine/token_bytes.py).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvrt.engine")

KINDS = ("json_object", "json_schema", "regex")
MAX_SPEC_BYTES = 64 << 10  # a schema or regex larger than this is no structured-output spec
MAX_CACHED = 64            # compiled grammars kept (least recently asked dropped first)
GRAMMAR_TIMEOUT_S = 120.0  # how long a request waits for its grammar before it fails


def guided_problem(guided: object, check_regex: bool = False) -> str:
    """The first problem with a request's `guided` field, or "": its shape, whether its schema
    can be turned into a regex, and with `check_regex` whether outlines-core reads a regex at
    all (the HTTP server asks, to answer 400; the engine does not: a regex's automaton can grow
    exponentially with its text, and the engine's loop builds none, so a bad regex there fails
    its request when the compile thread meets it)."""
    if guided is None:
        return ""
    if not isinstance(guided, dict) or set(guided) - {"kind", "spec"} or "kind" not in guided:
        return f'guided must be {{"kind": one of {", ".join(KINDS)}, "spec": a string}} or null'
    kind, spec = guided.get("kind"), guided.get("spec", "")
    if kind not in KINDS:
        return f"guided kind must be one of {', '.join(KINDS)}, got {str(kind)[:40]!r}"
    if not isinstance(spec, str):
        return "guided spec must be a string (a JSON schema as JSON text, or a regex)"
    if len(spec.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
        return f"guided spec is longer than {MAX_SPEC_BYTES} bytes"
    try:
        regex = regex_of(guided)
        if check_regex and kind == "regex":
            _check_regex(regex)
    except ValueError as e:
        return str(e)
    return ""


def regex_of(guided: dict) -> str:
    """The regex a guided spec stands for (ValueError says what is wrong with the spec)."""
    kind, spec = guided["kind"], guided.get("spec", "")
    if kind == "regex":
        if not spec:
            raise ValueError("guided regex is empty")
        return spec
    from outlines_core.json_schema import build_regex_from_schema

    if kind == "json_object":
        return json_object_regex()
    try:
        parsed = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"guided json_schema is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("guided json_schema must be a JSON object (a schema)")
    try:
        return build_regex_from_schema(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"guided json_schema is not a schema kvrt can follow: {e}") from None


def _check_regex(regex: str) -> None:
    """ValueError when outlines-core cannot read `regex`: its automaton over a vocabulary of
    the 256 single bytes, which any regex over text can use (fast: no real vocabulary)."""
    from outlines_core import Index, Vocabulary

    try:
        Index(regex, Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    except ValueError as e:
        raise ValueError(f"guided regex {regex[:60]!r} is not a regex kvrt can follow: {e}") from None


def json_object_regex() -> str:
    """JSON mode's regex: an object whose values are strings, numbers, booleans, null, or
    objects and arrays of those (outlines-core's pieces, and its optional single space)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE as WS

    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"

    def obj(value: str) -> str:
        member = f"{STRING}{WS}:{WS}{value}"
        return rf"\{{{WS}({member}({WS},{WS}{member})*)?{WS}\}}"

    def arr(value: str) -> str:
        return rf"\[{WS}({value}({WS},{WS}{value})*)?{WS}\]"

    return obj(f"({scalar}|{obj(scalar)}|{arr(scalar)})")


def describe(guided: dict) -> str:
    """A short name of a spec for messages: its kind and the start of its text."""
    spec = guided.get("spec", "")
    return guided["kind"] + (f" {spec[:60]!r}" + ("..." if len(spec) > 60 else "") if spec else "")


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar: its outlines-core Index, and how many token ids its vocabulary spans
    (a mask written from it needs room for all of them, even where the model has fewer)."""

    index: Any
    vocab_size: int


class Grammars:
    """Compiled grammars of one node, by (spec, EOS id); `token_bytes` loads the vocabulary
    (id -> bytes, runtime/engine/token_bytes.py), once, in the compile thread."""

    def __init__(self, token_bytes: Any, wake: Any = None, max_cached: int = MAX_CACHED):
        self._load = token_bytes
        self._wake = wake  # called (from the compile thread) when a compile ends
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvrt-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max = max_cached
        self._vocab: dict[int, Any] = {}      # EOS id -> outlines Vocabulary (compile thread only)
        self._bytes: dict[int, bytes] | None = None

    def compile(self, guided: dict, eos_token_id: int) -> Future:
        """The grammar of `guided` with `eos_token_id` as its end, compiled or on its way (a
        Future of a `Compiled`: its exception is a ValueError that names the spec). A failure is cached like a
        success: compiling is deterministic, so asking again would only fail again."""
        key = (guided["kind"], guided.get("spec", ""), eos_token_id)
        fut = self._cache.get(key)  # (the engine's thread only: the compile thread never touches it)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        fut = self._pool.submit(self._build, dict(guided), eos_token_id)
        if self._wake is not None:
            fut.add_done_callback(lambda _: self._wake())
        self._cache[key] = fut
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return fut

    def _build(self, guided: dict, eos: int) -> Compiled:
        from outlines_core import Index

        try:
            regex = regex_of(guided)
            index = Index(regex, self._vocabulary(eos))
        except ValueError as e:
            raise ValueError(f"cannot compile guided {describe(guided)}: {e}") from None
        log.info("compiled guided %s", describe(guided))
        return Compiled(index, max(max(self._bytes), eos) + 1)

    def _vocabulary(self, eos: int) -> Any:
        from outlines_core import Vocabulary

        if eos not in self._vocab:
            if self._bytes is None:
                self._bytes = self._load()
            by_bytes: dict[bytes, list[int]] = {}
            for tid, b in self._bytes.items():
                if tid != eos and b:
                    by_bytes.setdefault(b, []).append(tid)
            self._vocab[eos] = Vocabulary(eos, by_bytes)
        return self._vocab[eos]

    def close(self) -> None:
        """Stop taking compiles; queued ones are dropped, one in flight runs to its end (not
        waited for here)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
