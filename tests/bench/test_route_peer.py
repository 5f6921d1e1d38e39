"""`kvrt bench route --peer`: the text prompts both routers get, and the options."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrt.bench.route import _first_token, as_text, parse_args
from kvrt.runtime.client.tokenizer import ByteTokenizer


@given(st.lists(st.integers(0, 511), min_size=1, max_size=64), st.lists(st.integers(0, 511), max_size=16))
def test_text_prompts_keep_the_prompts_sharing_one_byte_token_per_id(shared, tail):
    a, b = np.asarray(shared + tail), np.asarray(shared)
    ta, tb = as_text(a), as_text(b)
    assert ta.startswith(tb) and len(ByteTokenizer().encode(ta)) == len(a)


def test_first_token_is_an_event_with_text_or_token_ids():
    assert _first_token('data: {"choices": [{"text": "a", "token_ids": [5]}]}')
    assert _first_token('data: {"choices": [{"text": "a"}]}')
    assert not _first_token('data: {"choices": [{"text": "", "token_ids": []}]}')
    assert not _first_token("data: [DONE]")


def test_peer_options_are_checked():
    args = parse_args(["--peer", "sglang-router", "--small-blocks", "300", "--limit", "10"])
    assert args.peer == "sglang-router" and args.small_blocks == 300
    with pytest.raises(SystemExit):
        parse_args(["--peer", "nginx"])
    with pytest.raises(SystemExit):
        parse_args(["--small-blocks", "-1"])
    assert parse_args(["--trace", "synthetic:chats:100"]).synthetic == "chats:100"
    with pytest.raises(SystemExit):
        parse_args(["--trace", "synthetic:nope"])
