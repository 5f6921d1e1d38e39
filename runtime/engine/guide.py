"""One guided request's place in its grammar: the automaton state that its output so far reached,
and the tokens allowed next, as a packed bitmask for the worker's sampler.

Why the state lives with the Sequence and moves with each appended token: the output tokens
are the request's truth. A preempted request keeps its output (only its KV is recomputed), and
a decode node that gets a request from a prefill node appends the first token like any other,
so the state is right on every path without being sent anywhere. A token appended before the
grammar is compiled (a decode node's first token, while its own compile runs) waits in
`_early` and is replayed once the index is there.

Why the engine holds it and the worker only gets a mask (the split vLLM v1 makes too): the
engine already sees every token of every request, on every path, while the worker holds no
per-request state at all (a step is self-contained, so a preempted or handed-off request needs
nothing moved); the sampler then applies the mask in the same pass as the rest of sampling.

The mask is bit t % 32 of word t // 32 set when token t is allowed (outlines-core writes it so),
int32 words as the step message carries them. A state that allows no token is dead: the
request fails rather than sample outside its grammar.
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from kvrt.runtime.engine.grammars import GRAMMAR_TIMEOUT_S, describe


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's mask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


class GuideState:
    """The automaton state of one request under `guided` (an index compiling or compiled) over
    a model of `vocab_size` tokens. `mask` holds the tokens allowed next once `ready()`.
    `problem` is set, and the request must fail, once the grammar cannot be followed: it did
    not compile, did not compile in time, or came to a state that allows no token."""

    def __init__(self, guided: dict, index: Future, eos_token_id: int, vocab_size: int,
                 timeout_s: float = GRAMMAR_TIMEOUT_S):
        self.guided = guided
        self.eos_token_id = eos_token_id
        self.problem = ""
        self.refused = False  # the problem is the spec's own (a bad request), not the node's
        self.finished = False  # the EOS was taken in a final state
        self.mask = np.zeros(mask_words(vocab_size), np.int32)
        self.vocab_size = vocab_size
        self._scratch: np.ndarray | None = None  # the whole mask, when the tokenizer spans more ids
        self._index = index
        self._guide = None     # outlines_core.Guide, once the index is there
        self._early: list[int] = []
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def ready(self) -> bool:
        """True once the index is there (the state then follows every token); False while it
        compiles, and for good once `problem` is set."""
        if self._guide is not None:
            return not self.problem
        if self.problem:
            return False
        if not self._index.done():
            if time.monotonic() > self._deadline:
                self.problem = (f"the grammar of guided {describe(self.guided)} did not compile within "
                                f"{self._timeout_s:g}s")
            return False
        err = self._index.exception()
        if err is not None:
            self.problem = str(err)
            self.refused = bool(getattr(err, "refused", False))
            return False
        from outlines_core import Guide

        compiled = self._index.result()
        self._guide = Guide(compiled.index)
        words = mask_words(compiled.vocab_size)
        self._scratch = np.zeros(words, np.int32) if words > len(self.mask) else None
        self._refresh()
        early, self._early = self._early, []
        for token in early:
            self.advance(token)
        return not self.problem

    def advance(self, token: int) -> None:
        """The request's next output token: the state follows it."""
        if self.problem or self.finished:
            return
        if self._guide is None:
            self._early.append(token)
            return
        if token == self.eos_token_id and self.eos_token_id >= 0:
            if self._guide.is_finished():
                self.finished = True
            else:
                self.problem = f"the EOS token came before guided {describe(self.guided)} was complete"
            return
        try:
            self._guide.advance(int(token), return_tokens=False)
        except ValueError:
            self.problem = f"token {token} is outside guided {describe(self.guided)} (no transition)"
            return
        self._refresh()

    def _refresh(self) -> None:
        """`mask` from the state (a tokenizer with ids past the model's vocabulary is written
        whole into a scratch first, and cut: the model cannot produce those); an empty one is a
        dead state."""
        out = self.mask if self._scratch is None else self._scratch
        out[:] = 0
        self._guide.write_mask_into(out.ctypes.data, out.size, 4)
        if self._scratch is not None:
            self.mask[:] = self._scratch[:len(self.mask)]
            past = len(self.mask) * 32 - self.vocab_size  # bits of the last word past the model's tokens
            if past:
                self.mask.view(np.uint32)[-1] &= np.uint32((1 << (32 - past)) - 1)
        if not self.mask.any():
            self.problem = f"guided {describe(self.guided)} came to a state that allows no token of this model"


def guide_for(req: object, grammars: object, vocab_size: int, client: bytes = b"") -> GuideState | None:
    """The grammar state of a new request (GenerateRequest, or a P->D preallocation carrying
    the same fields) whose `guided` passed intake; None when it is not guided. Its grammar is
    compiled, or on its way, in `grammars` (runtime/engine/grammars.py), as `client`'s."""
    if req.guided is None:
        return None
    return GuideState(req.guided, grammars.compile(req.guided, req.eos_token_id, client), req.eos_token_id,
                      vocab_size)
