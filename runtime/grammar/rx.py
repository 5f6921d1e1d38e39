"""Regular expressions built from parts, each part carrying an estimate of the automaton it adds.

Why an estimate travels with the text: a grammar's cost is its automaton, and the automaton of a
short text can be huge (`.{0,1000000000}` is 19 characters). Building a regex from parts that
know their own size (`states`: the automaton states the part adds, a bounded repeat counting its
body once per repetition; `wide`: those of them where most of a vocabulary can go next, since
each of those holds a transition for nearly every token) lets a compile be refused before any
automaton exists (runtime/grammar/limits.py), and lets a generator stop as soon as a part passes
the budget instead of building a text that is the attack itself.

The text is the dialect that both outlines-core's Rust regex and Python's `re` read the same way:
only `(?:...)`, `|`, `?`, `*`, `+`, `{m,n}`, classes, and every character that is not a letter
or digit written as a hex escape (`\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`), so tests can check texts
with `re` that the compiled automaton accepts.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_CODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
WIDE_CLASS = 64  # a class of more characters than this lets most of a vocabulary through


class TooBig(ValueError):
    """A regex passed its budget while it was being built (`limits.py` names the limit)."""


def esc(cp: int) -> str:
    """One character as the shared dialect writes it."""
    ch = chr(cp)
    if ch.isascii() and ch.isalnum():
        return ch
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


@dataclass(frozen=True)
class Rx:
    """A regex text and its automaton estimate (`states`, of which `wide`); `atom` is True when
    the text can take a quantifier as it is. `empty` is the regex of no text; `None` stands for
    a part that matches nothing at all (an impossible schema branch)."""

    text: str
    states: int
    wide: int = 0
    atom: bool = False


EMPTY = Rx("", 0, 0, False)


class Budget:
    """The most `states` a regex being built may reach; `check` raises TooBig past it."""

    def __init__(self, max_states: int, why: str = ""):
        self.max_states = max_states
        self.why = why  # where the limit comes from, for the message

    def check(self, r: Rx) -> Rx:
        if r.states > self.max_states:
            raise TooBig(f"about {r.states} automaton states, above the limit of {self.max_states}{self.why}")
        return r


def lit(text: str) -> Rx:
    """`text` itself."""
    return Rx("".join(esc(ord(c)) for c in text), len(text.encode("utf-8")), 0, len(text) == 1)


def ranges_class(ranges: list[tuple[int, int]]) -> Rx | None:
    """A class of code points (sorted, disjoint inclusive ranges, surrogates left out); None when
    it holds none."""
    ranges = [r for r in _without_surrogates(ranges)]
    if not ranges:
        return None
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        cp = ranges[0][0]
        return Rx(esc(cp), len(chr(cp).encode("utf-8")), 0, True)
    body = "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)
    count = sum(b - a + 1 for a, b in ranges)
    multibyte = ranges[-1][1] >= 0x80
    states = 8 if multibyte else 1  # a range of multi-byte UTF-8 characters is several byte states
    return Rx(f"[{body}]", states, states if count > WIDE_CLASS else 0, True)


def _without_surrogates(ranges: list[tuple[int, int]]):
    lo_s, hi_s = SURROGATES
    for a, b in ranges:
        if b < lo_s or a > hi_s:
            yield a, b
            continue
        if a < lo_s:
            yield a, lo_s - 1
        if b > hi_s:
            yield hi_s + 1, b


def group(r: Rx) -> Rx:
    return r if r.atom else Rx(f"(?:{r.text})", r.states, r.wide, True)


def seq(*parts: Rx | None) -> Rx | None:
    """The parts one after another (None when any is None: nothing matches)."""
    if any(p is None for p in parts):
        return None
    parts = [p for p in parts if p.text]
    if len(parts) == 1:
        return parts[0]
    return Rx("".join(p.text if p.atom or "|" not in p.text else group(p).text for p in parts),
              sum(p.states for p in parts), sum(p.wide for p in parts), False)


def alt(*parts: Rx | None) -> Rx | None:
    """Any one of the parts (the None ones left out; None when none is left)."""
    live = list(dict.fromkeys(p for p in parts if p is not None))
    if not live:
        return None
    if len(live) == 1:
        return live[0]
    if any(not p.text for p in live):
        rest = [p for p in live if p.text]
        return opt(alt(*rest))
    return Rx("|".join(p.text for p in live), sum(p.states for p in live), sum(p.wide for p in live), False)


def opt(r: Rx | None) -> Rx:
    if r is None or not r.text:
        return EMPTY
    return Rx(group(r).text + "?", r.states, r.wide, True)


def star(r: Rx | None) -> Rx:
    if r is None or not r.text:
        return EMPTY
    return Rx(group(r).text + "*", r.states, r.wide, True)


def rep(r: Rx | None, lo: int, hi: int | None, budget: Budget) -> Rx | None:
    """`r` from `lo` to `hi` times (None: no end). Its estimate counts the body once per
    repetition that must be spelled out (`hi`, or `lo` + 1 without an end), and is checked
    against `budget` before any text is made."""
    if r is None:
        return EMPTY if lo == 0 else None
    if hi is not None and hi < lo:
        return None
    if not r.text or hi == 0:
        return EMPTY
    copies = hi if hi is not None else lo + 1
    budget.check(Rx("", r.states * copies, 0))
    est = Rx("", r.states * copies, r.wide * copies)
    body = group(r).text
    if (lo, hi) == (0, None):
        q = "*"
    elif (lo, hi) == (1, None):
        q = "+"
    elif (lo, hi) == (0, 1):
        q = "?"
    elif (lo, hi) == (1, 1):
        return r
    elif hi is None:
        q = f"{{{lo},}}"
    elif lo == hi:
        q = f"{{{lo}}}"
    else:
        q = f"{{{lo},{hi}}}"
    return Rx(body + q, est.states, est.wide, True)
