"""runtime/client/stop.py: stop strings found in streamed text however it is split, nothing after
(or of) the stop string shown, and nothing held back at the end of an answer without one."""
from __future__ import annotations

import pytest

from kvrt.runtime.client.stop import MAX_STOP_STRINGS, StopStrings


def stream(pieces, stops):
    scan = StopStrings(stops)
    shown = "".join(scan.feed(p) for p in pieces) + scan.flush()
    return shown, scan.stopped


def truncate_at_stop(text, stops):
    """The whole text cut before its first stop string, and which one: one piece streamed."""
    return stream([text], stops)


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_stop_string_split_anywhere_is_found(cut):
    text = "Hello<|end|> world"
    assert stream([text[:cut], text[cut:]], ["<|end|>"]) == ("Hello", "<|end|>")
    assert stream(list(text), ["<|end|>"]) == ("Hello", "<|end|>")


def test_the_earliest_stop_string_wins_and_nothing_comes_after_it():
    assert truncate_at_stop("abc STOP def END", ["END", "STOP"]) == ("abc ", "STOP")
    scan = StopStrings(["\n\n"])
    assert scan.feed("one\n") == "one"
    assert scan.feed("\ntwo") == "" and scan.stopped == "\n\n"
    assert scan.feed("three") == "" and scan.flush() == ""


def test_held_back_text_is_released_when_it_is_not_a_stop():
    scan = StopStrings(["</s>"])
    assert scan.feed("a</") == "a"  # "</" may start the stop string
    assert scan.feed("b") == "</b"
    assert scan.feed("x<") == "x" and scan.flush() == "<" and scan.stopped is None
    assert truncate_at_stop("no stop here", ["zz"]) == ("no stop here", None)
    assert stream(["héllo ", "wörld"], []) == ("héllo wörld", None)


@pytest.mark.parametrize("stops", ["x", [""], [3], ["a" * 257], ["s"] * (MAX_STOP_STRINGS + 1)])
def test_bad_stop_strings_are_refused(stops):
    with pytest.raises(ValueError, match="stop"):
        StopStrings(stops)
