"""A client's regular expression (a JSON Schema `pattern`, or `guided_regex`) rewritten into the
dialect of runtime/grammar/rx.py, with what it means made explicit and its size estimated.

Why parse and rewrite rather than pass the text through: the text would be read by outlines-core's
Rust regex, whose `\\d` is any Unicode digit while JSON Schema's (ECMA-262) is `[0-9]`, and a
client's `pattern` must hold for the decoded string inside a JSON document, where `"` and `\\`
are written escaped. Parsing (Python's own regex parser, `re._parser`) gives the structure:

- `\\d`, `\\w`, `\\s` are ASCII (`[0-9]`, `[A-Za-z0-9_]`, space and `\\t\\n\\v\\f\\r`), and
  the negated ones (`\\D`, `[^...]`) stay inside printable ASCII, so every character written
  is what both ECMA-262 and Python's `re` (which jsonschema uses) accept;
- `.` is any character but a line break;
- inside a JSON string (`in_json=True`) a `"` or `\\` the pattern allows is written escaped, and
  control characters are left out (a JSON string cannot hold them raw);
- a JSON Schema `pattern` is a search, but a string that is wholly one match of it also
  contains one, so the pattern's body is generated whole and anchors at its ends are dropped;
- what a regular automaton cannot hold (look-around, back-references, anchors inside the
  pattern, word boundaries, inline flags, possessive or atomic groups) is refused by name.
"""
from __future__ import annotations

try:  # Python >= 3.11
    import re._constants as C
    import re._parser as sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as sre  # type: ignore[no-redef]

from kvrt.runtime.grammar.rx import EMPTY, MAX_CODE, Budget, Rx, alt, lit, ranges_class, rep, seq

MAX_PATTERN_BYTES = 4096
MAX_NESTING = 64  # groups inside groups (the parser recurses once per level)

DIGIT = [(0x30, 0x39)]
WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE = [(0x09, 0x0D), (0x20, 0x20)]
PRINTABLE = [(0x20, 0x7E)]
ANY_BUT_BREAK = [(0x00, 0x09), (0x0B, 0x0C), (0x0E, 0x2027), (0x202A, MAX_CODE)]
_CATEGORIES = {C.CATEGORY_DIGIT: (DIGIT, False), C.CATEGORY_NOT_DIGIT: (DIGIT, True),
               C.CATEGORY_WORD: (WORD, False), C.CATEGORY_NOT_WORD: (WORD, True),
               C.CATEGORY_SPACE: (SPACE, False), C.CATEGORY_NOT_SPACE: (SPACE, True)}
# inside a JSON string: what a character is written as when it cannot stand for itself
_JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x0A: "\\n", 0x09: "\\t", 0x0D: "\\r", 0x08: "\\b", 0x0C: "\\f"}


class PatternError(ValueError):
    """A regex kvrt cannot turn into an automaton (the message says what in it)."""


def normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if lo <= hi:
                out.append((lo, hi))
    return normalize(out)


def subtract(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = normalize(xs)
    for c, d in normalize(ys):
        nxt = []
        for a, b in out:
            if d < a or c > b:
                nxt.append((a, b))
                continue
            if a < c:
                nxt.append((a, c - 1))
            if b > d:
                nxt.append((d + 1, b))
        out = nxt
    return out


def char_set(ranges: list[tuple[int, int]], in_json: bool) -> Rx | None:
    """A set of characters as a regex: itself, or inside a JSON string each as JSON writes it
    (control characters left out)."""
    ranges = normalize(ranges)
    if not in_json:
        return ranges_class(ranges)
    plain = subtract(ranges, [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
    escaped = [lit(text) for cp, text in _JSON_ESCAPES.items() if intersect(ranges, [(cp, cp)])]
    return alt(ranges_class(plain), *escaped)


def parse(text: str) -> list:
    """The parsed pattern (PatternError when Python's parser refuses it or it nests too deep)."""
    if len(text.encode("utf-8", "replace")) > MAX_PATTERN_BYTES:
        raise PatternError(f"it is longer than {MAX_PATTERN_BYTES} bytes")
    depth = deepest = 0
    escaped = False
    for ch in text:  # a bound on nesting before the recursive parser sees it
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    if deepest > MAX_NESTING:
        raise PatternError(f"its groups nest {deepest} deep, more than {MAX_NESTING}")
    try:
        parsed = sre.parse(text)
    except (C.error, RecursionError, OverflowError, ValueError) as e:
        raise PatternError(f"it is not a regex kvrt reads: {e}") from None
    if parsed.state.flags & (C.SRE_FLAG_IGNORECASE | C.SRE_FLAG_MULTILINE | C.SRE_FLAG_DOTALL | C.SRE_FLAG_VERBOSE
                             | C.SRE_FLAG_ASCII | C.SRE_FLAG_LOCALE):
        raise PatternError("inline flags such as (?i) are not supported")
    return list(parsed)


def to_rx(text: str, budget: Budget, in_json: bool, search: bool) -> Rx | None:
    """`text` as a regex of the shared dialect (see the module docstring). `search`: the
    pattern is searched for (JSON Schema), so anchors at its ends are dropped; otherwise it is
    matched whole (guided_regex) and may carry none. None when it matches nothing."""
    items = parse(text)
    if search:
        items = _strip_anchors(items)
    return _seq(items, budget, in_json)


def _strip_anchors(items: list) -> list:
    """A pattern's body without `^` at its start or `$` at its end (one level of top-level
    alternation is looked into: `^a$|^b$`)."""
    if len(items) == 1 and items[0][0] is C.BRANCH:
        _, (_, branches) = items[0]
        return [(C.BRANCH, (None, [_strip_anchors(list(b)) for b in branches]))]
    items = list(items)
    while items and items[0] == (C.AT, C.AT_BEGINNING):
        items.pop(0)
    while items and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING):
        items.pop()
    return items


def _seq(items, budget: Budget, in_json: bool) -> Rx | None:
    out = EMPTY
    for op, arg in items:
        out = budget.check(seq(out, _item(op, arg, budget, in_json)))
        if out is None:
            return None
    return out


def _item(op, arg, budget: Budget, in_json: bool) -> Rx | None:
    if op is C.LITERAL:
        return char_set([(arg, arg)], in_json)
    if op is C.NOT_LITERAL:
        return char_set(subtract(PRINTABLE, [(arg, arg)]), in_json)
    if op is C.ANY:
        return char_set(ANY_BUT_BREAK, in_json)
    if op is C.IN:
        return char_set(_class(arg), in_json)
    if op is C.BRANCH:
        return alt(*[_seq(list(b), budget, in_json) for b in arg[1]])
    if op is C.SUBPATTERN:
        _, add_flags, del_flags, sub = arg
        if add_flags or del_flags:
            raise PatternError("inline flags such as (?i) are not supported")
        return _seq(list(sub), budget, in_json)
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):
        lo, hi, sub = arg
        body = _seq(list(sub), budget, in_json)
        return rep(body, lo, None if hi == C.MAXREPEAT else hi, budget)
    if op is C.AT:
        raise PatternError(f"the anchor or boundary {str(arg).lower()} is only supported at the pattern's ends"
                           if arg in (C.AT_BEGINNING, C.AT_END, C.AT_END_STRING, C.AT_BEGINNING_STRING)
                           else f"{str(arg).lower()} (a word boundary) is not supported")
    names = {C.GROUPREF: "back-references", C.GROUPREF_EXISTS: "conditional groups", C.ASSERT: "look-arounds",
             C.ASSERT_NOT: "look-arounds"}
    for name in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP"):
        if hasattr(C, name):
            names[getattr(C, name)] = "possessive and atomic groups"
    raise PatternError(f"{names.get(op, str(op).lower())} cannot be held by a regular automaton")


def _class(items) -> list[tuple[int, int]]:
    """A class's code points. A negated class, or one holding a negated category, is taken
    within printable ASCII (what every regex dialect agrees it excludes and allows)."""
    negate = False
    ranges: list[tuple[int, int]] = []
    for op, arg in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            ranges.append((arg, arg))
        elif op is C.RANGE:
            ranges.append(arg)
        elif op is C.CATEGORY:
            base, negated = _CATEGORIES.get(arg, (None, False))
            if base is None:
                raise PatternError(f"the class {str(arg).lower()} is not supported")
            if negated:
                ranges += subtract(PRINTABLE, base)
            else:
                ranges += base
        else:
            raise PatternError(f"{str(op).lower()} inside a class is not supported")
    if negate:
        return subtract(PRINTABLE, ranges)
    return normalize(ranges)


def widths(text: str, search: bool) -> tuple[int, int | None]:
    """The fewest and most characters of what `to_rx` generates for `text` (None: no most)."""
    items = parse(text)
    lo, hi = sre.SubPattern(sre.State(), _strip_anchors(items) if search else items).getwidth()
    return lo, (None if hi >= C.MAXREPEAT else hi)





def bounded(text: str, lo: int, hi: int | None, budget: Budget) -> Rx | None:
    """`to_rx` of a searched pattern whose whole is one repeated character (`^[a-z]+$`), with
    its repeat narrowed to [lo, hi] characters; None when it is not of that shape."""
    items = _strip_anchors(parse(text))
    if len(items) != 1 or items[0][0] not in (C.MAX_REPEAT, C.MIN_REPEAT):
        return None
    a, b, sub = items[0][1]
    if sre.SubPattern(sre.State(), list(sub)).getwidth() != (1, 1):
        return None
    b = None if b == C.MAXREPEAT else b
    lo, hi = max(a, lo), (b if hi is None else hi if b is None else min(b, hi))
    return rep(_seq(list(sub), budget, True), lo, hi, budget)
