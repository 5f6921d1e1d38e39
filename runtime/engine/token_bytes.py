"""The bytes each token of a checkpoint's tokenizer stands for: what a grammar over text needs
to know of a vocabulary.

Why bytes, not strings: a byte-level BPE (GPT-2, Qwen2, Llama 3) writes each byte of its tokens
as one printable character ("Ġ" is a space), and a token may hold part of a UTF-8 character, so
its string is neither its text nor valid UTF-8 on its own. The grammar's automaton runs over
bytes, so each token is mapped to the exact bytes it adds to the output: byte-level tokens
through the inverse of the byte-to-character table, SentencePiece-style tokens ("▁" for a space,
"<0x0A>" for a fallback byte) through those two conventions, added tokens as their UTF-8 text.

Special tokens (the added tokens marked special: EOS, chat markers) are left out: they are no
text, and a grammar allows only its EOS, which the index handles itself, in final states.
"""
from __future__ import annotations

import json
import os
import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPACE_MARK = "\u2581"  # SentencePiece's "▁"


def byte_level_table() -> dict[str, int]:
    """The byte-level BPE's character -> byte table: printable Latin-1 bytes stand for
    themselves, every other byte for the character 256 + its rank among those others."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer_json: dict) -> tuple[dict[int, bytes], set[int]]:
    """(token id -> bytes for every text token, ids of the special tokens) of a parsed
    tokenizer.json (see the module docstring)."""
    model = tokenizer_json.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    added = tokenizer_json.get("added_tokens") or []
    special = {int(t["id"]) for t in added if t.get("special")}
    byte_level = _uses_byte_level(tokenizer_json)
    table = byte_level_table() if byte_level else {}
    out: dict[int, bytes] = {}
    for piece, tid in vocab.items():
        if tid in special:
            continue
        out[int(tid)] = _piece_bytes(piece, table) if byte_level else _sentencepiece_bytes(piece)
    for t in added:
        if not t.get("special"):
            out[int(t["id"])] = str(t["content"]).encode("utf-8")
    return out, special


def read_token_bytes(directory: str) -> tuple[dict[int, bytes], set[int]]:
    """`token_bytes` of DIR/tokenizer.json (ValueError names the file when it cannot be used)."""
    path = os.path.join(directory, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            return token_bytes(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: cannot read the vocabulary for guided decoding: {e}") from None


def _uses_byte_level(tj: dict) -> bool:
    """True when the decoder (or, without one, the pre-tokenizer) is byte-level, possibly
    inside a Sequence."""
    for part in (tj.get("decoder"), tj.get("pre_tokenizer")):
        if part:
            kinds = [part.get("type")] + [p.get("type") for p in part.get("decoders", part.get("pretokenizers", []))
                                          or []]
            return "ByteLevel" in kinds
    return False


def _piece_bytes(piece: str, table: dict[str, int]) -> bytes:
    """A byte-level piece's bytes; a character outside the table (a piece the tokenizer
    added by hand) as its UTF-8."""
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


def _sentencepiece_bytes(piece: str) -> bytes:
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(SPACE_MARK, " ").encode("utf-8")
