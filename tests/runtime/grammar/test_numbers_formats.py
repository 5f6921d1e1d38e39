"""Numbers within bounds and string formats, as regexes (runtime/grammar/numbers.py,
formats.py): an integer regex matches exactly the integers of its range; every number a bounded
number regex spells lies within the bounds; every value a format regex spells is one the
standard library's parsers (and jsonschema's checkers, where they check) accept."""
from __future__ import annotations

import datetime
import ipaddress
import re
import uuid

import pytest
from hypothesis import assume, given, settings, strategies as st

from kvrt.runtime.grammar.formats import FORMATS
from kvrt.runtime.grammar.numbers import LIMIT, integers, numbers, whole_bounds

bound = st.one_of(st.none(), st.integers(-10**6, 10**6))


@settings(max_examples=150, deadline=None)
@given(lo=bound, hi=bound, xs=st.lists(st.integers(-2 * 10**6, 2 * 10**6), max_size=20))
def test_an_integer_regex_matches_exactly_its_range(lo, hi, xs):
    rx = integers(lo, hi)
    if lo is not None and hi is not None and lo > hi:
        assert rx is None
        return
    pattern = re.compile(rx.text)
    for x in xs + [v for v in (lo, hi) if v is not None] + [0, -1, 1, LIMIT, -LIMIT]:
        inside = (lo is None or x >= lo) and (hi is None or x <= hi)
        assert bool(pattern.fullmatch(str(x))) == inside, (lo, hi, x, rx.text)
    assert not pattern.fullmatch("-0") and not pattern.fullmatch("007")


@settings(max_examples=100, deadline=None)
@given(lo=st.one_of(st.none(), st.floats(-1e4, 1e4)), hi=st.one_of(st.none(), st.floats(-1e4, 1e4)),
       ex_lo=st.booleans(), ex_hi=st.booleans(), data=st.data())
def test_every_number_a_bounded_regex_spells_is_within_its_bounds(lo, hi, ex_lo, ex_hi, data):
    a, b = whole_bounds(lo, hi, ex_lo, ex_hi)
    assume(a is None or b is None or a <= b)
    rx = numbers(a, b, lo is not None or hi is not None)
    text = data.draw(st.from_regex(re.compile(rx.text), fullmatch=True))
    value = float(text)
    if lo is not None:
        assert value > lo if ex_lo else value >= lo, (lo, text)
    if hi is not None:
        assert value < hi if ex_hi else value <= hi, (hi, text)


CHECKS = {
    "date": datetime.date.fromisoformat,
    "time": lambda v: datetime.time.fromisoformat(v.replace("Z", "+00:00")),
    "date-time": lambda v: datetime.datetime.fromisoformat(v.replace("Z", "+00:00")),
    "uuid": lambda v: uuid.UUID(v),
    "ipv4": ipaddress.IPv4Address,
    "email": lambda v: v.count("@") == 1 or (_ for _ in ()).throw(ValueError(v)),
    "hostname": lambda v: all(0 < len(p) <= 63 for p in v.split(".")) or (_ for _ in ()).throw(ValueError(v)),
    "uri": lambda v: re.match(r"https?://[^/\s]+", v) or (_ for _ in ()).throw(ValueError(v)),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_format_values_are_accepted_by_parsers_and_jsonschema(name, data):
    value = data.draw(st.from_regex(re.compile(FORMATS[name]), fullmatch=True))
    CHECKS[name](value)
    jsonschema = pytest.importorskip("jsonschema")
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER  # (date-time and time with rfc3339-validator)
    assert checker.conforms(value, name), (name, value)
