"""A byte-level tokenizer: text -> UTF-8 bytes -> token ids 0..255, and back.

Why bytes: kvrt's default model is a small test model, and a byte tokenizer needs no vocabulary
file to download, has no merges to get wrong, and maps every string to ids and back exactly.
Token ids are the bytes themselves, so any model with a vocabulary of at least 256 ids accepts
them. Decoding never raises: an id outside 0..255 (a model may sample one) and bytes that are not
valid UTF-8 both come out as U+FFFD, the replacement character.
"""
from __future__ import annotations

import codecs
from typing import Iterable

VOCAB_SIZE = 256
REPLACEMENT = "\ufffd"


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of `text` as token ids."""
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int]) -> str:
    """Token ids -> text; ids >= 256 (or < 0) and invalid UTF-8 become U+FFFD. Never raises."""
    dec = StreamDecoder()
    return dec.feed(token_ids) + dec.flush()


class StreamDecoder:
    """Decodes tokens as they stream in: a character split over two token events is printed once
    it is complete, not as two replacement characters."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Iterable[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for t in token_ids:
            t = int(t)
            if 0 <= t < VOCAB_SIZE:
                run.append(t)
                continue
            # not a byte: end the pending character (as a replacement if incomplete), then U+FFFD
            out.append(self._utf8.decode(bytes(run), final=True))
            run.clear()
            out.append(REPLACEMENT)
        out.append(self._utf8.decode(bytes(run)))
        return "".join(out)

    def flush(self) -> str:
        """What an unfinished trailing character leaves (a replacement character, or nothing)."""
        return self._utf8.decode(b"", final=True)
