"""`guided_grammar`: a context-free grammar as vLLM takes it, in GBNF (`root ::= ...`, llama.cpp's
and xgrammar's EBNF) or Lark (`start: ...`), turned into a regex when it is not recursive.

Why a regex: kvrt's grammars are automata (outlines-core's Index), and a grammar none of whose
rules reaches itself describes a regular language, which is what most grammars sent with a
request are (a command, a choice of phrases, a date). A recursive rule (nested expressions,
JSON itself) cannot be an automaton, so it is refused naming the rule, never cut at a depth.

Read: rules (`name ::= body` or Lark's `name: body`, `?name`/`!name` marks ignored), string
literals, character classes (GBNF's `[a-z]`), Lark's `/regex/` and `"a".."z"` ranges and its
`[optional]` groups, `(...)`, `|`, `?`, `*`, `+`, GBNF's `{m}`/`{m,n}`, and comments (`#` in
GBNF, `//` in Lark). Refused by name: Lark directives (`%import`, `%ignore`), case-insensitive
literals, and regex flags.
"""
from __future__ import annotations

import json
import re

from kvrt.runtime.grammar.pattern import PatternError, to_rx
from kvrt.runtime.grammar.rx import EMPTY, Budget, Rx, alt, lit, ranges_class, rep, seq

MAX_NESTING = 64
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*|//[^\n]*)
  | (?P<define>::=|:)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.[0-9]+)?)
  | (?P<range>\.\.)
  | (?P<number>[0-9]+)
  | (?P<directive>%[a-z]+)
  | (?P<punct>[()|?*+{},\[\]])
""", re.X)


class GrammarRefused(ValueError):
    """A grammar kvrt cannot turn into an automaton (the message says what in it)."""


def _tokens(text: str, gbnf: bool) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        if gbnf and text[at] == "[":  # GBNF: a character class, read as a regex class
            end = at + 1
            while end < len(text) and text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            if end >= len(text):
                raise GrammarRefused(f"an unclosed character class at offset {at}")
            out.append(("class", text[at:end + 1]))
            at = end + 1
            continue
        m = _TOKEN.match(text, at)
        if m is None:
            raise GrammarRefused(f"cannot read the grammar at offset {at}: {text[at:at + 20]!r}")
        kind = m.lastgroup
        if kind == "directive":
            raise GrammarRefused(f"the directive {m.group()} is not supported")
        if kind not in ("space", "comment"):
            out.append((kind, m.group()))
        at = m.end()
    return out


def _literal(text: str) -> str:
    """A quoted literal's text (its escapes as JSON's)."""
    try:
        return json.loads(text)
    except ValueError:
        raise GrammarRefused(f"the literal {text[:40]} has an escape kvrt does not read") from None


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], gbnf: bool):
        self.toks, self.at, self.gbnf, self.depth = tokens, 0, gbnf, 0
        self.rules: dict[str, tuple] = {}

    def peek(self, k: int = 0) -> tuple[str, str]:
        i = self.at + k
        return self.toks[i] if i < len(self.toks) else ("end", "")

    def rule_starts(self) -> bool:
        return self.peek()[0] == "name" and self.peek(1)[0] == "define"

    def grammar(self) -> dict[str, tuple]:
        while self.peek()[0] != "end":
            if not self.rule_starts():
                raise GrammarRefused(f"expected a rule (name ::= ... or name: ...), got {self.peek()[1]!r}")
            name = self.peek()[1].lstrip("?!").split(".")[0]
            self.at += 2
            if name in self.rules:
                raise GrammarRefused(f"rule {name!r} is defined twice")
            self.rules[name] = self.alternation()
        return self.rules

    def alternation(self) -> tuple:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise GrammarRefused(f"groups nest more than {MAX_NESTING} deep")
        options = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.at += 1
            options.append(self.sequence())
        self.depth -= 1
        return ("alt", options)

    def sequence(self) -> tuple:
        items = []
        while True:
            kind, text = self.peek()
            if kind == "end" or self.rule_starts() or (kind == "punct" and text in "|)]"):
                return ("seq", items)
            items.append(self.quantified(self.item()))

    def item(self) -> tuple:
        kind, text = self.peek()
        self.at += 1
        if kind == "string":
            if text.endswith("i"):
                raise GrammarRefused(f"case-insensitive literals ({text}) are not supported")
            value = _literal(text)
            if self.peek()[0] == "range":
                self.at += 1
                k2, t2 = self.peek()
                self.at += 1
                if k2 != "string":
                    raise GrammarRefused("a range .. needs a literal on each side")
                end = _literal(t2)
                if len(value) != 1 or len(end) != 1:
                    raise GrammarRefused("a range .. is between single characters")
                return ("class", [(ord(value), ord(end))])
            return ("lit", value)
        if kind == "regex":
            body, _, flags = text[1:].rpartition("/")
            if flags:
                raise GrammarRefused(f"regex flags ({flags}) are not supported")
            return ("regex", body)
        if kind == "class":
            return ("regex", text)
        if kind == "name":
            return ("ref", text.lstrip("?!").split(".")[0])
        if (kind, text) == ("punct", "("):
            inner = self.alternation()
            self.expect(")")
            return inner
        if (kind, text) == ("punct", "[") and not self.gbnf:  # Lark: an optional group
            inner = self.alternation()
            self.expect("]")
            return ("rep", inner, 0, 1)
        raise GrammarRefused(f"unexpected {text!r} in the grammar")

    def quantified(self, item: tuple) -> tuple:
        kind, text = self.peek()
        if kind != "punct" or text not in "?*+{":
            return item
        self.at += 1
        if text in "?*+":
            return ("rep", item, 0 if text != "+" else 1, 1 if text == "?" else None)
        lo = self.number()
        hi: int | None = lo
        if self.peek() == ("punct", ","):
            self.at += 1
            hi = None if self.peek() == ("punct", "}") else self.number()
        self.expect("}")
        return ("rep", item, lo, hi)

    def number(self) -> int:
        kind, text = self.peek()
        if kind != "number":
            raise GrammarRefused(f"expected a count, got {text!r}")
        self.at += 1
        return int(text)

    def expect(self, punct: str) -> None:
        if self.peek() != ("punct", punct):
            raise GrammarRefused(f"expected {punct!r}, got {self.peek()[1]!r}")
        self.at += 1


def grammar_rx(text: str, budget: Budget) -> Rx:
    """The regex of a non-recursive grammar's start rule (`root` in GBNF, `start` in Lark)."""
    gbnf = "::=" in text
    rules = _Parser(_tokens(text, gbnf), gbnf).grammar()
    start = "root" if gbnf else "start"
    if start not in rules:
        raise GrammarRefused(f"the grammar has no {start!r} rule to start from")
    done: dict[str, Rx | None] = {}

    def emit(node: tuple, path: tuple[str, ...]) -> Rx | None:
        kind = node[0]
        if kind == "lit":
            return lit(node[1])
        if kind == "class":
            return ranges_class(node[1])
        if kind == "regex":
            try:
                return to_rx(node[1], budget, in_json=False, search=False)
            except PatternError as e:
                raise GrammarRefused(f"the regex {node[1][:40]!r}: {e}") from None
        if kind == "ref":
            name = node[1]
            if name in path:
                raise GrammarRefused(f"rule {name!r} is recursive ({' -> '.join(path[path.index(name):] + (name,))}), "
                                     f"which a regular automaton cannot hold")
            if name not in rules:
                raise GrammarRefused(f"rule {name!r} is used but not defined")
            if name not in done:
                done[name] = emit(rules[name], path + (name,))
            return done[name]
        if kind == "seq":
            out: Rx | None = EMPTY
            for item in node[1]:
                out = seq(out, emit(item, path))
                if out is None:
                    return None
                budget.check(out)
            return out
        if kind == "alt":
            return budget.check(alt(*[emit(o, path) for o in node[1]]))
        return rep(emit(node[1], path), node[2], node[3], budget)

    got = emit(("ref", start), ())
    if got is None:
        raise GrammarRefused("the grammar matches nothing")
    return got
