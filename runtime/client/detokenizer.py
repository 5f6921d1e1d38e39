"""Incremental detokenization: the text of a stream of output tokens, piece by piece, never
garbage in the middle.

Why not decode each token alone: a byte-level BPE token can hold half of a UTF-8 character
("é" split over two tokens decodes as two U+FFFD on its own), and SentencePiece-style decoders
drop the leading space of a sequence's first token, so a token's text depends on its neighbours.
So each step decodes a short window of recent tokens twice, without and with the new ones, and
emits only the difference, and only once the window's text no longer ends in an incomplete
character (U+FFFD). The window starts `prefix_offset` tokens in; `read_offset` is where the
text already emitted ends. With the prompt's last few tokens as the first window, the first
output token is decoded in context too. Output that never becomes valid text is held back until
it does or the stream ends (`flush` prints it as it is, U+FFFD included).
"""
from __future__ import annotations

from typing import Iterable

from kvrt.runtime.client.tokenizer import REPLACEMENT, Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens the first window starts with


class IncrementalDetokenizer:
    """Feed output token ids as they arrive (`add`), print what it returns, and `flush` at the
    end. The pieces joined equal the text of all output tokens decoded at once (in the prompt's
    context)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT, 0)

    def add(self, token_ids: Iterable[int]) -> str:
        """The new text that `token_ids` complete ("" while a character is still incomplete)."""
        self.tokens.extend(int(t) for t in token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end comes out as
        U+FFFD: the stream ended inside it)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        complete = len(text) > len(prefix) and not text.endswith(REPLACEMENT)
        if not (complete or final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
