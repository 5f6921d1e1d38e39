"""A JSON Schema as a regex of the JSON texts that satisfy it: every keyword that asserts
something is either enforced by the regex or refused by name (`Refused`), never dropped.

Why kvrt writes this rather than take outlines-core's converter: that one passes `minimum`,
`maximum`, `format` and most other assertions by without a word, so answers broke their schema.
Here each keyword has one of three fates, listed in docs/guide.md (structured output):

- enforced: type, enum, const, properties, required, additionalProperties, minProperties and
  maxProperties (by which properties are written), propertyNames, dependentRequired and
  dependencies (a property whose dependents are not all required is not written), items,
  prefixItems, additionalItems, minItems, maxItems, uniqueItems (at most one item is written),
  minLength, maxLength, pattern (runtime/grammar/pattern.py), format (runtime/grammar/formats.py),
  minimum, maximum, exclusiveMinimum, exclusiveMaximum (runtime/grammar/numbers.py), multipleOf 1,
  allOf (merged), anyOf, oneOf (when its branches cannot overlap), $ref within the document
  (a recursive one unrolled MAX_RECURSION levels), unevaluatedProperties and unevaluatedItems
  (only declared properties and items are written);
- refused, naming the keyword: not, if/then/else, contains, multipleOf other than 1,
  $dynamicRef, $recursiveRef, a $ref to another document, patternProperties that a written
  property name matches, and any combination the regex cannot hold (a pattern with length bounds
  its matches may break, a oneOf whose branches may overlap);
- annotations (title, description, default, examples, ...) and keywords outside JSON Schema
  assert nothing, so a validator ignores them, and so does this.

A grammar writes a subset of the valid documents (properties in their declared order, at most
MAX_DIGITS digits, one space at most between tokens): soundness is the promise, not coverage.
"""
from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from kvrt.runtime.grammar import formats
from kvrt.runtime.grammar.numbers import RangeError, integers, numbers, whole_bounds
from kvrt.runtime.grammar.pattern import PRINTABLE, PatternError, bounded, char_set, to_rx, widths
from kvrt.runtime.grammar.rx import EMPTY, MAX_CODE, Budget, Rx, TooBig, alt, lit, opt, rep, seq, star

MAX_RECURSION = 2   # times a recursive $ref is entered on one path before that branch is dropped
ANY_DEPTH = 2       # nesting of a value the schema leaves free (objects and arrays within it)
FIRST_CHOICES = 4   # with no required property, which of the first properties may open the object
WS = Rx("\\x20?", 1, 0, True)
COMMA = seq(WS, lit(","), WS)
COLON = seq(WS, lit(":"), WS)
STRING_CHAR = char_set([(0x20, MAX_CODE)], in_json=True)
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# a number where the schema says nothing of it: its digits uncapped (a cap is a state per digit in
# every place a value can be, which doubled JSON mode's automaton)
ANY_NUMBER = Rx("\\x2d?(?:0|[1-9][0-9]*)(?:\\x2e[0-9]+)?", 6, 0, False)

REFUSED = {"not": "a regular grammar cannot exclude what a subschema allows",
           "if": "conditional schemas are not supported", "then": "conditional schemas are not supported",
           "else": "conditional schemas are not supported",
           "contains": "an array that must contain a match is not supported",
           "minContains": "an array that must contain a match is not supported",
           "maxContains": "an array that must contain a match is not supported",
           "$dynamicRef": "dynamic references are not supported",
           "$recursiveRef": "recursive references are not supported"}
# keywords by the type they constrain: a schema without "type" is the types its keywords name
FAMILIES = {"object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                       "maxProperties", "propertyNames", "dependentRequired", "dependencies", "dependentSchemas",
                       "unevaluatedProperties"),
            "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                      "unevaluatedItems"),
            "string": ("minLength", "maxLength", "pattern", "format"),
            "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")}
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "id", "readOnly",
               "writeOnly", "deprecated", "$anchor", "$dynamicAnchor", "$vocabulary", "contentMediaType",
               "contentEncoding", "contentSchema", "definitions", "$defs", "format_description"}
ASSERTIONS = ({"type", "enum", "const", "allOf", "anyOf", "oneOf", "$ref"} | set(REFUSED)
              | {k for ks in FAMILIES.values() for k in ks})


class Refused(ValueError):
    """A schema, or a keyword in it, that the grammar cannot enforce: `keyword` names it."""

    def __init__(self, keyword: str, path: str, why: str):
        super().__init__(f"{keyword} at {path}: {why}")
        self.keyword = keyword


def schema_regex(schema: Any, budget: Budget) -> Rx:
    """The regex of the JSON texts that satisfy `schema` (Refused, or rx.TooBig past `budget`)."""
    got = _Converter(schema, budget).value(schema, "#")
    if got is None:
        raise Refused("schema", "#", "kvrt's grammar finds no JSON value that satisfies it")
    return got


def any_value(depth: int = ANY_DEPTH) -> Rx:
    """Any JSON value nested at most `depth` levels (what a schema that says nothing allows)."""
    scalar = alt(seq(lit('"'), star(STRING_CHAR), lit('"')), ANY_NUMBER, lit("true"), lit("false"),
                 lit("null"))
    if depth <= 0:
        return scalar
    inner = any_value(depth - 1)
    member = seq(seq(lit('"'), star(STRING_CHAR), lit('"')), COLON, inner)
    obj = seq(lit("{"), WS, opt(seq(member, star(seq(COMMA, member)))), WS, lit("}"))
    arr = seq(lit("["), WS, opt(seq(inner, star(seq(COMMA, inner)))), WS, lit("]"))
    return alt(scalar, obj, arr)


def _types(s: dict) -> list[str]:
    """The JSON types a flattened schema may produce."""
    t = s.get("type")
    if t is None:
        named = [f for f, ks in FAMILIES.items() if any(k in s for k in ks)]
        if "number" in named:
            named.append("integer")
        return named or list(TYPES)
    return [t] if isinstance(t, str) else list(t)


class _Converter:
    def __init__(self, root: Any, budget: Budget):
        self.root = root
        self.budget = budget
        self.stack: list[str] = []  # the $refs being written, outermost first

    # ---- one schema ----------------------------------------------------------------------
    def value(self, s: Any, path: str) -> Rx | None:
        flat, refs = self.flatten(s, path)
        if flat is None:
            return None
        self.stack += refs
        try:
            got = self._value(flat, path)
        finally:
            del self.stack[len(self.stack) - len(refs):]
        return got if got is None else self.budget.check(got)

    def _value(self, s: dict | bool, path: str) -> Rx | None:
        if s is True:
            return any_value()
        if s is False:
            return None
        for k in s:
            if k in REFUSED:
                if k in ("then", "else") and "if" not in s:
                    continue
                if k == "if" and "then" not in s and "else" not in s:
                    continue
                if k in ("minContains", "maxContains") and "contains" not in s:
                    continue
                raise Refused(k, path, REFUSED[k])
        if "enum" in s or "const" in s:
            return self._enum(s, path)
        if "anyOf" in s or "oneOf" in s:
            return self._branches(s, path)
        rest = {k: v for k, v in s.items() if k in ASSERTIONS}
        if not rest:
            return any_value()
        types = _types(s)
        if not all(isinstance(t, str) and t in TYPES for t in types):
            raise Refused("type", path, f"unknown type in {str(s.get('type'))[:80]}")
        if "integer" in types and "number" in types:
            types.remove("integer")
        return alt(*[self._typed(t, s, path) for t in types])

    def _typed(self, t: str, s: dict, path: str) -> Rx | None:
        if t == "object":
            return self._object(s, path)
        if t == "array":
            return self._array(s, path)
        if t == "string":
            return self._string(s, path)
        if t in ("number", "integer"):
            return self._number(s, path, t == "integer")
        return alt(lit("true"), lit("false")) if t == "boolean" else lit("null")

    # ---- $ref and allOf -------------------------------------------------------------------
    def flatten(self, s: Any, path: str, depth: int = 0) -> tuple[dict | bool | None, list[str]]:
        """`s` with its $ref and allOf merged into one schema, and the $refs it entered; None
        when a recursive $ref went MAX_RECURSION levels deep (that branch is not written)."""
        if isinstance(s, bool):
            return s, []
        if not isinstance(s, dict):
            raise Refused("schema", path, "a schema is an object or a boolean")
        if depth > 32:
            raise Refused("$ref", path, "references nest more than 32 deep")
        refs: list[str] = []
        out: dict | bool = {k: v for k, v in s.items() if k not in ("$ref", "allOf")}
        parts = []
        if "$ref" in s:
            ref = s["$ref"]
            if not isinstance(ref, str):
                raise Refused("$ref", path, "a reference is a string")
            if (self.stack + refs).count(ref) >= MAX_RECURSION:
                return None, []
            refs.append(ref)
            parts.append((self._resolve(ref, path), ref))
        all_of = s.get("allOf", [])
        if not isinstance(all_of, list):
            raise Refused("allOf", path, "allOf is a list of schemas")
        parts += [(m, f"{path}/allOf/{i}") for i, m in enumerate(all_of)]
        for part, where in parts:
            self.stack += refs
            try:
                flat, more = self.flatten(part, where, depth + 1)
            finally:
                del self.stack[len(self.stack) - len(refs):]
            if flat is None:
                return None, []
            refs += more
            out = _merge(out, flat, path)
        return out, refs

    def _resolve(self, ref: str, path: str) -> Any:
        if not ref.startswith("#"):
            raise Refused("$ref", path, f"{ref[:80]!r} points outside the schema (only #/... references are followed)")
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise Refused("$ref", path, f"{ref[:80]!r} points to nothing in the schema")
        return node

    # ---- enum, const, anyOf, oneOf ---------------------------------------------------------
    def _enum(self, s: dict, path: str) -> Rx | None:
        values = s["enum"] if "enum" in s else None
        if values is not None and not isinstance(values, list):
            raise Refused("enum", path, "enum is a list")
        if "const" in s:
            values = [v for v in (values if values is not None else [s["const"]]) if _same(v, s["const"])]
        rest = {k: v for k, v in s.items() if k in ASSERTIONS and k not in ("enum", "const")}
        texts = [json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values]
        if rest:  # the values the rest of the schema allows too
            other = self._value(rest, path)
            if other is None:
                return None
            pattern = re.compile(other.text)
            texts = [t for t in texts if pattern.fullmatch(t)]
        return alt(*[lit(t) for t in dict.fromkeys(texts)])

    def _branches(self, s: dict, path: str) -> Rx | None:
        key = "anyOf" if "anyOf" in s else "oneOf"
        branches = s[key]
        if not isinstance(branches, list) or not branches:
            raise Refused(key, path, f"{key} is a non-empty list of schemas")
        rest = {k: v for k, v in s.items() if k != key}
        flats, out = [], []
        for i, b in enumerate(branches):
            where = f"{path}/{key}/{i}"
            flat, refs = self.flatten(b, where)
            if flat is None or flat is False:
                continue
            merged = _merge(rest, flat, where) if isinstance(flat, dict) else rest
            flats.append(merged)
            self.stack += refs
            try:
                out.append(self.value(merged, where))
            finally:
                del self.stack[len(self.stack) - len(refs):]
        if key == "oneOf":
            live = [f for f, r in zip(flats, out) if r is not None]
            for i in range(len(live)):
                for j in range(i + 1, len(live)):
                    if not _disjoint(live[i], live[j]):
                        raise Refused("oneOf", path, f"its branches may overlap (a value could match more than "
                                                     f"one, which oneOf forbids)")
        return alt(*out)

    # ---- types ----------------------------------------------------------------------------
    def _number(self, s: dict, path: str, integer: bool) -> Rx | None:
        m = s.get("multipleOf")
        if m is not None:
            if m != 1:
                raise Refused("multipleOf", path, f"only multipleOf 1 is enforced, got {str(m)[:40]}")
            integer = True
        bounds = {}
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(k)
            if v is not None and not isinstance(v, bool) and not isinstance(v, (int, float)):
                raise Refused(k, path, "a bound is a number")
            bounds[k] = v
        lo = hi = None
        if bounds["minimum"] is not None:
            lo = whole_bounds(bounds["minimum"], None, bounds["exclusiveMinimum"] is True, False)[0]
        if bounds["maximum"] is not None:
            hi = whole_bounds(None, bounds["maximum"], False, bounds["exclusiveMaximum"] is True)[1]
        if not isinstance(bounds["exclusiveMinimum"], bool) and bounds["exclusiveMinimum"] is not None:
            x = whole_bounds(bounds["exclusiveMinimum"], None, True, False)[0]
            lo = x if lo is None else max(lo, x)
        if not isinstance(bounds["exclusiveMaximum"], bool) and bounds["exclusiveMaximum"] is not None:
            x = whole_bounds(None, bounds["exclusiveMaximum"], False, True)[1]
            hi = x if hi is None else min(hi, x)
        if integer:
            return integers(lo, hi)
        try:
            return numbers(lo, hi, lo is not None or hi is not None)
        except RangeError as e:
            raise Refused("minimum" if "minimum" in s or "exclusiveMinimum" in s else "maximum", path, str(e)) from None

    def _string(self, s: dict, path: str) -> Rx | None:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        for k, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise Refused(k, path, "a length is a non-negative integer")
        pattern, fmt = s.get("pattern"), s.get("format")
        quote = lit('"')
        if fmt is not None:
            if fmt not in formats.FORMATS:
                raise Refused("format", path, f"format {str(fmt)[:40]!r} is not one kvrt enforces "
                                              f"({', '.join(formats.FORMATS)})")
            if pattern is not None:
                raise Refused("pattern", path, "a pattern together with a format is not supported")
            text = formats.FORMATS[fmt]
            wlo, whi = widths(text, False)
            if lo > wlo or (hi is not None and (whi is None or whi > hi)):
                raise Refused("minLength" if lo > wlo else "maxLength", path,
                              f"the length bounds cut into format {fmt!r}'s values")
            return seq(quote, Rx(f"(?:{text})", formats.STATES[fmt], 0, True), quote)
        if pattern is not None:
            if not isinstance(pattern, str):
                raise Refused("pattern", path, "a pattern is a string")
            try:
                body = to_rx(pattern, self.budget, in_json=True, search=True)
                wlo, whi = widths(pattern, True)
                if lo > wlo or (hi is not None and (whi is None or whi > hi)):
                    body = bounded(pattern, lo, hi, self.budget)
                    if body is None:
                        raise Refused("minLength" if lo > wlo else "maxLength", path,
                                      "length bounds together with a pattern whose matches may break them")
            except PatternError as e:
                raise Refused("pattern", path, f"{pattern[:60]!r}: {e}") from None
            return seq(quote, body, quote)
        try:
            return seq(quote, rep(STRING_CHAR, lo, hi, self.budget), quote)
        except TooBig as e:
            raise Refused("maxLength" if hi is not None else "minLength", path, str(e)) from None

    def _array(self, s: dict, path: str) -> Rx | None:
        try:
            return self._items(s, path)
        except TooBig as e:
            raise Refused("maxItems" if s.get("maxItems") is not None else "minItems", path, str(e)) from None

    def _items(self, s: dict, path: str) -> Rx | None:
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        for k, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise Refused(k, path, "a count is a non-negative integer")
        if s.get("uniqueItems") is True:
            if lo > 1:
                raise Refused("uniqueItems", path, "unique items are enforced by writing at most one, "
                                                   f"and minItems is {lo}")
            hi = 1 if hi is None else min(hi, 1)
        items = s.get("items", True)
        prefix = s.get("prefixItems", [])
        if isinstance(items, list):  # drafts 4-7: a tuple, then additionalItems
            prefix, items = items, s.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise Refused("prefixItems", path, "prefixItems is a list of schemas")
        if hi is not None:
            prefix = prefix[:hi]
        heads = [self.value(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        rest = self.value(items, f"{path}/items")
        k = len(heads)
        more_lo, more_hi = max(lo - k, 0), (None if hi is None else hi - k)
        if k == 0:
            if rest is None:
                body = EMPTY if lo == 0 else None
            else:
                first = seq(rest, rep(seq(COMMA, rest), max(lo - 1, 0), None if hi is None else hi - 1, self.budget))
                body = first if lo > 0 else opt(first)
        else:
            inner = EMPTY if rest is None or more_hi == 0 else rep(seq(COMMA, rest), more_lo, more_hi, self.budget)
            if inner is None or (rest is None and more_lo > 0):
                return None
            for i in range(k - 1, -1, -1):
                piece = seq(COMMA if i else EMPTY, heads[i], inner)
                inner = piece if i < lo else opt(piece)
                if inner is None:
                    return None
            body = inner
        return None if body is None else seq(lit("["), WS, body, WS, lit("]"))

    def _object(self, s: dict, path: str) -> Rx | None:
        props = s.get("properties", {})
        required = s.get("required", [])
        if not isinstance(props, dict):
            raise Refused("properties", path, "properties is an object of schemas")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise Refused("required", path, "required is a list of names")
        required = list(dict.fromkeys(required))
        extra = s.get("additionalProperties", True)
        drop: set[str] = set()
        for kw in ("dependentRequired", "dependencies", "dependentSchemas"):
            deps = s.get(kw, {})
            if not isinstance(deps, dict):
                raise Refused(kw, path, f"{kw} is an object")
            for name, need in deps.items():
                if isinstance(need, list):
                    if name in required:
                        required += [n for n in need if n not in required]
                    elif not all(n in required for n in need):
                        drop.add(name)  # never written, so its dependents are never needed
                elif name in required:
                    raise Refused(kw, path, f"a schema that depends on required property {name!r} is not supported")
                else:
                    drop.add(name)
        ordered = [n for n in props if n not in drop or n in required] + [n for n in required if n not in props]
        min_p, max_p = s.get("minProperties", 0), s.get("maxProperties")
        optional = [n for n in ordered if n not in required]
        if min_p > len(required):  # the first optional properties become required
            if min_p > len(ordered):
                if props or min_p > 1:
                    raise Refused("minProperties", path, f"fewer than {min_p} properties can be written")
            required += optional[:min_p - len(required)]
        if max_p is not None:
            if len(required) > max_p:
                return None
            keep = set(required) | set([n for n in ordered if n not in required][:max_p - len(required)])
            ordered = [n for n in ordered if n in keep]
        if not props and not required:
            return self._map(s, extra, min_p, max_p, path)
        pattern_props = s.get("patternProperties", {})
        names_schema = s.get("propertyNames")
        names_rx = None
        if names_schema is not None:
            got = self.value(names_schema if isinstance(names_schema, bool) else {"type": "string", **names_schema},
                             f"{path}/propertyNames")
            names_rx = re.compile(got.text) if got is not None else None
        members = []
        for n in ordered:
            key = json.dumps(n, ensure_ascii=False)
            for p in pattern_props if isinstance(pattern_props, dict) else ():
                try:
                    hit = re.search(p, n)
                except re.error:
                    hit = True
                if hit:
                    raise Refused("patternProperties", path, f"property {n!r} also matches pattern {p[:40]!r}")
            if names_schema is not None and (names_rx is None or not names_rx.fullmatch(key)):
                if n in required:
                    return None
                continue
            where = f"{path}/properties/{n}"
            sub = props[n] if n in props else extra
            v = self.value(sub, where)
            if v is None:
                if n in required:
                    return None
                continue
            members.append((seq(lit(key), COLON, v), n in required))
        return seq(lit("{"), WS, self._members(members), WS, lit("}"))

    def _members(self, members: list[tuple[Rx, bool]]) -> Rx:
        """Properties in order, each required one always and each optional one at most once,
        with commas only between written ones."""
        if not members:
            return EMPTY
        first_req = next((i for i, (_, req) in enumerate(members) if req), None)

        def tail(start: int) -> Rx:
            out = EMPTY
            for m, req in members[start:]:
                piece = seq(COMMA, m)
                out = self.budget.check(seq(out, piece if req else opt(piece)))
            return out

        if first_req is not None:
            head = seq(*[opt(seq(m, COMMA)) for m, _ in members[:first_req]]) if first_req else EMPTY
            return seq(head, members[first_req][0], tail(first_req + 1))
        firsts = [seq(m, tail(i + 1)) for i, (m, _) in enumerate(members[:FIRST_CHOICES])]
        return opt(alt(*firsts))

    def _map(self, s: dict, extra: Any, min_p: int, max_p: int | None, path: str) -> Rx | None:
        """An object with no declared properties: free names, each value under
        additionalProperties (a name could come twice, so at most one is required)."""
        if s.get("patternProperties"):
            if min_p:
                raise Refused("patternProperties", path, "names that must match a pattern are not written, "
                                                         f"and minProperties is {min_p}")
            return seq(lit("{"), WS, lit("}"))
        if extra is False:
            return None if min_p else seq(lit("{"), WS, lit("}"))
        if min_p > 1:
            raise Refused("minProperties", path, "more than one free-named property cannot be enforced")
        names_schema = s.get("propertyNames")
        key = self.value({"type": "string", **names_schema} if isinstance(names_schema, dict) else names_schema,
                         f"{path}/propertyNames") if names_schema is not None else seq(
            lit('"'), rep(char_set(PRINTABLE, True), 1, None, self.budget), lit('"'))
        v = self.value(extra, f"{path}/additionalProperties") if extra is not True else any_value(ANY_DEPTH - 1)
        if key is None or v is None:
            return None if min_p else seq(lit("{"), WS, lit("}"))
        member = seq(key, COLON, v)
        body = seq(member, rep(seq(COMMA, member), 0, None if max_p is None else max_p - 1, self.budget))
        if max_p == 0:
            body = None
        return seq(lit("{"), WS, body if min_p else opt(body), WS, lit("}"))


def _same(a: Any, b: Any) -> bool:
    """JSON equality (a boolean is not a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _merge(a: dict | bool, b: dict | bool, path: str) -> dict | bool:
    """Both schemas at once, as one (Refused when kvrt cannot merge them)."""
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    out = dict(a)
    for k, v in b.items():
        if k not in out or out[k] == v or k in ANNOTATIONS or k not in ASSERTIONS:
            out.setdefault(k, v)
            continue
        old = out[k]
        if k == "required":
            out[k] = list(dict.fromkeys(list(old) + list(v)))
        elif k == "properties" and isinstance(old, dict) and isinstance(v, dict):
            out[k] = {**old, **{n: ({"allOf": [old[n], s]} if n in old else s) for n, s in v.items()}}
        elif k == "type":
            x = {old} if isinstance(old, str) else set(old)
            y = {v} if isinstance(v, str) else set(v)
            both = (x & y) | ({"integer"} if ("integer" in x and "number" in y) or ("number" in x and "integer" in y)
                              else set())
            out[k] = sorted(both)
        elif k in ("minimum", "minLength", "minItems", "minProperties") and _numeric(old, v):
            out[k] = max(old, v)
        elif k in ("maximum", "maxLength", "maxItems", "maxProperties") and _numeric(old, v):
            out[k] = min(old, v)
        elif k == "enum" and isinstance(old, list) and isinstance(v, list):
            out[k] = [x for x in old if any(_same(x, y) for y in v)]
        elif k in ("anyOf", "oneOf"):
            out.setdefault("allOf", [])
            out["allOf"] = list(out["allOf"]) + [{k: v}]
        else:
            raise Refused("allOf", path, f"two of its schemas set {k!r} differently, which kvrt cannot merge")
    return out


def _numeric(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)


def _disjoint(a: dict, b: dict) -> bool:
    """True when no JSON value can satisfy both flattened schemas (as far as cheap checks see)."""
    ta, tb = set(_types(a)), set(_types(b))
    for t in (ta, tb):
        if "number" in t:
            t.add("integer")
    if not ta & tb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(_same(x, y) for x in va for y in vb):
        return True
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or []) & set(b.get("required") or []):
        x, y = pa.get(name), pb.get(name)
        if isinstance(x, dict) and isinstance(y, dict):
            vx, vy = _values(x), _values(y)
            if vx is not None and vy is not None and not any(_same(i, j) for i in vx for j in vy):
                return True
    for x, y in ((a, b), (b, a)):  # one requires a property the other forbids
        if x.get("additionalProperties") is False and ta & tb == {"object"}:
            if any(r not in (x.get("properties") or {}) for r in y.get("required") or []):
                return True
    return False


def _values(s: dict) -> list | None:
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return s["enum"]
    return None
