from hypothesis import given
from hypothesis import strategies as st

from kvrt.runtime.client.detokenizer import IncrementalDetokenizer
from kvrt.runtime.client.tokenizer import BYTE_VOCAB_SIZE, REPLACEMENT, ByteTokenizer

BYTES = ByteTokenizer()
encode, decode = BYTES.encode, BYTES.decode


@given(st.text())
def test_round_trip(text):
    ids = encode(text)
    assert all(0 <= t < 256 for t in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text


@given(st.text(), st.lists(st.integers(1, 7)))
def test_streaming_decode_matches_whole(text, cuts):
    ids = encode(text)
    dec, out, i = IncrementalDetokenizer(BYTES), [], 0
    for c in cuts + [len(ids)]:
        out.append(dec.add(ids[i:i + c]))
        i += c
    out.append(dec.add(ids[i:]))
    assert "".join(out) + dec.flush() == text


@given(st.lists(st.integers(-2**31, 2**31 - 1)))
def test_decode_never_raises(ids):
    out = decode(ids)
    assert isinstance(out, str)


def test_bad_ids_and_bytes_become_replacement_chars():
    assert decode([72, 105, 256, 33]) == f"Hi{REPLACEMENT}!"
    assert decode([-1]) == REPLACEMENT
    assert decode([0xFF, 65]) == f"{REPLACEMENT}A"
    assert decode([0xE2, 0x82]) == REPLACEMENT      # a truncated 3-byte character
    assert decode([0xE2, 0x82, 1000, 0x41]) == f"{REPLACEMENT}{REPLACEMENT}A"
    assert encode("é€") == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert BYTE_VOCAB_SIZE == BYTES.vocab_size == 256
    assert BYTES.eos_token_ids == () and BYTES.chat_template is None
