"""Guided decoding's grammars on the engine's side: each request's spec compiled once, by the
node's compile processes (runtime/grammar/pool.py), and kept while it is asked for again.

Why the engine only asks and waits: a grammar's automaton can cost minutes and gigabytes, so
it is built in a process the pool can kill at its time limit, held to a memory limit, with one
client's compiles never ahead of another's (runtime/grammar/pool.py); a request waits for its
grammar aside (runtime/engine/client_api.py, scheduler.py), never the loop.

Why the cache counts bytes: agents send the same schema over and over, so a compiled index is
kept by (spec, EOS id); an index is as large as its automaton's states times the vocabulary
(runtime/grammar/limits.py), so the cache is bounded by the bytes of what it holds, not by a
count. A failure is cached like a success: compiling is deterministic, so asking again would
only fail again (a failure of the node's own, such as a compile process that could not start,
is not kept).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

from kvrt.runtime.grammar import messages as M
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.pool import Compiled, CompilePool
from kvrt.runtime.grammar.spec import GrammarError, describe, guided_problem  # noqa: F401 (the engine's names)

log = logging.getLogger("kvrt.engine")

CACHE_BYTES = 1 << 30      # compiled indexes kept (least recently asked dropped first)
CACHE_ENTRIES = 1024       # and at most this many specs, compiled, failed or on their way
GRAMMAR_TIMEOUT_S = 120.0  # how long a request waits for its grammar (queued and compiled) before it fails

__all__ = ["CACHE_BYTES", "CACHE_ENTRIES", "GRAMMAR_TIMEOUT_S", "Compiled", "GrammarError", "Grammars", "describe", "guided_problem"]


class Grammars:
    """Compiled grammars of one node, by (kind, spec, EOS id), compiled by a CompilePool over
    the vocabulary `setup` names."""

    def __init__(self, setup: M.Setup, limits: Limits | None = None, workers: int = 2,
                 wake: Callable[[], None] | None = None, cache_bytes: int = CACHE_BYTES):
        self.pool = CompilePool(setup, limits or Limits(), workers, wake)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_bytes = cache_bytes

    def compile(self, guided: dict, eos_token_id: int, client: bytes = b"") -> Future:
        """The grammar of `guided` with `eos_token_id` as its end, compiled or on its way (a
        Future of a `Compiled`; its exception a GrammarError that names the spec). `client`:
        whose compile it is (compiles take turns by client)."""
        key = (guided["kind"], guided.get("spec", ""), eos_token_id)
        fut = self._cache.get(key)  # (the engine's thread only)
        if fut is not None and not (fut.done() and _node_failure(fut)):
            self._cache.move_to_end(key)
            return fut
        fut = self.pool.submit(guided, eos_token_id, client)
        self._cache[key] = fut
        self._trim()
        return fut

    def _trim(self) -> None:
        held = sum(f.result().nbytes for f in self._cache.values() if f.done() and f.exception() is None)
        while (held > self._max_bytes or len(self._cache) > CACHE_ENTRIES) and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            if old.done() and old.exception() is None:
                held -= old.result().nbytes

    def close(self) -> None:
        """Stop: compiles waiting fail, the compile processes are killed."""
        self.pool.close()


def _node_failure(fut: Future) -> bool:
    err = fut.exception()
    return isinstance(err, GrammarError) and not err.refused

