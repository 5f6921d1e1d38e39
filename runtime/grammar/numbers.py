"""JSON numbers within bounds, as regexes: what enforces a schema's minimum, maximum and their
exclusive forms.

Why whole numbers carry the bounds: a range of integers is a finite set of digit patterns
(`[lo, hi]` split into runs that share a prefix and end in free digits). A number with bounds is
written as a whole number in range, or as `k.ddd` where every value from k to k + 1 lies in the
range (k >= 0; mirrored for negative values), so any digits after the point keep it inside.
A range that holds no whole number (0.1 to 0.5) is refused rather than guessed.

Why the digits are capped (MAX_DIGITS before the point, MAX_FRACTION after): an unbounded
integer lets a model write thousands of digits, which many JSON readers refuse (Python's int()
stops at 4,300); a capped one is still a valid answer to every schema.
"""
from __future__ import annotations

import math

from kvrt.runtime.grammar.rx import Rx, alt, lit, seq

MAX_DIGITS = 16
MAX_FRACTION = 8
LIMIT = 10 ** MAX_DIGITS - 1


class RangeError(ValueError):
    """Bounds a regex of numbers cannot follow (the message says why)."""


def _digits(n: int) -> Rx:
    return Rx("" if n == 0 else ("[0-9]" if n == 1 else f"[0-9]{{{n}}}"), n, 0, n <= 1)


def _same_len(a: str, b: str) -> list[Rx]:
    """Digit strings of one length from `a` to `b` (a <= b), as patterns."""
    if a == b:
        return [lit(a)]
    i = 0
    while a[i] == b[i]:
        i += 1
    prefix, a, b = a[:i], a[i:], b[i:]
    n = len(a) - 1

    def head(lo: str, hi: str) -> Rx:
        return lit(lo) if lo == hi else Rx(f"[{lo}-{hi}]", 1, 0, True)

    if a[1:] == "0" * n and b[1:] == "9" * n:
        return [seq(lit(prefix), head(a[0], b[0]), _digits(n))]
    out = [seq(lit(prefix + a[0]), tail) for tail in _same_len(a[1:], "9" * n)]
    if ord(b[0]) - ord(a[0]) > 1:
        out.append(seq(lit(prefix), head(chr(ord(a[0]) + 1), chr(ord(b[0]) - 1)), _digits(n)))
    out += [seq(lit(prefix + b[0]), tail) for tail in _same_len("0" * n, b[1:])]
    return out


def _naturals(lo: int, hi: int) -> Rx | None:
    """Whole numbers from `lo` to `hi` (0 <= lo), without leading zeros."""
    if lo > hi:
        return None
    if hi >= LIMIT:  # open above: the longer numbers are one pattern, not one per length
        d = len(str(lo))
        longer = Rx(f"[1-9][0-9]{{{d},{MAX_DIGITS - 1}}}", MAX_DIGITS, 0, False) if d < MAX_DIGITS else None
        return alt(_naturals(lo, 10 ** d - 1), longer)
    parts: list[Rx] = []
    for d in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (d - 1) if d > 1 else 0), min(hi, 10 ** d - 1)
        if a <= b:
            parts += _same_len(str(a), str(b))
    return alt(*parts)


def integers(lo: int | None, hi: int | None) -> Rx | None:
    """Integers in [lo, hi] (None: that side open, within MAX_DIGITS digits)."""
    lo = -LIMIT if lo is None else max(lo, -LIMIT)
    hi = LIMIT if hi is None else min(hi, LIMIT)
    if lo > hi:
        return None
    pos = _naturals(max(lo, 0), hi) if hi >= 0 else None
    neg = seq(lit("-"), _naturals(max(-hi, 1), -lo)) if lo < 0 and -lo >= max(-hi, 1) else None
    return alt(neg, pos)


def whole_bounds(minimum: float | None, maximum: float | None, exclusive_min: bool,
                 exclusive_max: bool) -> tuple[int | None, int | None]:
    """The least and greatest whole numbers the bounds allow (None: that side open)."""
    lo = hi = None
    if minimum is not None:
        lo = math.floor(minimum) + 1 if exclusive_min and float(minimum).is_integer() else math.ceil(minimum)
    if maximum is not None:
        hi = math.ceil(maximum) - 1 if exclusive_max and float(maximum).is_integer() else math.floor(maximum)
    return lo, hi


def numbers(lo: int | None, hi: int | None, bounded: bool) -> Rx | None:
    """JSON numbers between whole numbers `lo` and `hi` (see the module docstring); `bounded`
    says the schema had a bound, so that an empty range is an error rather than nothing."""
    whole = integers(lo, hi)
    if whole is None:
        if bounded:
            raise RangeError("the range holds no whole number, and kvrt writes numbers from whole ones")
        return None
    lo_c = -LIMIT if lo is None else max(lo, -LIMIT)
    hi_c = LIMIT if hi is None else min(hi, LIMIT)
    frac = Rx(f"\\x2e[0-9]{{1,{MAX_FRACTION}}}", 2, 0, False)
    top = LIMIT if hi is None else hi_c - 1  # (open above: k.ddd for every k)
    pos = _naturals(max(lo_c, 0), top) if top >= max(lo_c, 0) else None
    neg_lo, neg_hi = max(-hi_c, 0), (LIMIT if lo is None else -lo_c - 1)
    neg = seq(lit("-"), _naturals(neg_lo, neg_hi)) if neg_hi >= neg_lo else None
    return alt(whole, seq(alt(neg, pos), frac) if (neg or pos) else None)
