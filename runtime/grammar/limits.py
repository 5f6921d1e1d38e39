"""How much a grammar may cost to compile, and the estimate that refuses one before it is built.

Why estimate from the regex: outlines-core builds, for every automaton state, the transition of
every vocabulary token, so a compile takes time in proportion to states x vocabulary and holds
memory in proportion to the states where most tokens may go next (inside a string: each holds
a transition for nearly every token). Measured over a 151,936-token vocabulary on this project's
CPU machine: 35-95 ns per (state, token) pair to build, and about 13 bytes per (wide state,
token) pair held while building, one per pair in the finished index. The estimate takes the
middle of the time range and the top of the memory one; what it lets through is still bounded
by the compile process's time and memory limits (runtime/grammar/pool.py), which kill it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrt.runtime.grammar.rx import Budget, Rx

SECONDS_PER_PAIR = 50e-9
BUILD_BYTES_PER_WIDE_PAIR = 16
INDEX_BYTES_PER_WIDE_PAIR = 1
MAX_STATES = 200_000      # a regex is not even written past this many states, whatever the vocabulary


@dataclass(frozen=True)
class Limits:
    """One compile's limits: seconds (killed past it), bytes of memory (the compile process's
    address space beyond what it held before), and bytes of the compiled index the engine reads."""

    seconds: float = 20.0
    memory_bytes: int = 4 << 30
    # outlines-core reads an index back holding the GIL (about 12 ms per MiB here), which stalls
    # the engine's loop meanwhile: this bounds that stall to about 1.5 s
    index_bytes: int = 128 << 20

    def budget(self, vocab_size: int) -> Budget:
        """The states a regex may reach while it is written, for a vocabulary of `vocab_size`."""
        states = int(self.seconds / (SECONDS_PER_PAIR * max(vocab_size, 1)))
        if states >= MAX_STATES:
            return Budget(MAX_STATES, " that kvrt writes a regex to")
        return Budget(max(64, states), f" that the compile time limit of {self.seconds:g} s (kvrt launch "
                                       f"--grammar-timeout) allows over this model's {vocab_size} tokens")

    def problem(self, rx: Rx, vocab_size: int) -> str:
        """Why `rx` would pass a limit over `vocab_size` tokens, or ""."""
        seconds = rx.states * vocab_size * SECONDS_PER_PAIR
        building = rx.wide * vocab_size * BUILD_BYTES_PER_WIDE_PAIR
        index = rx.wide * vocab_size * INDEX_BYTES_PER_WIDE_PAIR
        what = f"its automaton (about {rx.states} states, {rx.wide} of them open to most tokens)"
        if seconds > self.seconds:
            return (f"{what} would take about {seconds:.0f} s to build over this model's {vocab_size} tokens, "
                    f"above the compile time limit of {self.seconds:g} s")
        if building > self.memory_bytes:
            return (f"{what} would need about {building >> 20} MiB to build, above the compile memory limit of "
                    f"{self.memory_bytes >> 20} MiB")
        if index > self.index_bytes:
            return (f"{what} would make an index of about {index >> 20} MiB, above the limit of "
                    f"{self.index_bytes >> 20} MiB")
        return ""
