"""How much text and how many token ids an HTTP request may hand the server's text work, from
the served model's length.

Why: tokenizing, detokenizing and rendering cost time in proportion to what they are given,
while the body limit (runtime/http/body_limit.py) leaves room for megabytes of text. Nothing a
model can take needs more: a prompt holds at most `max_model_len` tokens, and no tokenizer's
token stands for CHARS_PER_TOKEN characters on average over a whole prompt (English averages
about four), so a longer text is refused before it is tokenized, with a 400 naming the limit,
rather than tokenized for seconds to be refused as too long. Token ids to detokenize are bounded
by the model's length too: no sequence of the model is longer. A conversation has at most one
message per token of the model's length (every chat template writes a few tokens per turn).
"""
from __future__ import annotations

CHARS_PER_TOKEN = 32


def max_text_chars(max_model_len: int) -> int:
    """The longest text (in characters) a request of a model of this length may send to be
    tokenized, and the most a chat template may write for it."""
    return max_model_len * CHARS_PER_TOKEN


def text_problem(chars: int, max_model_len: int) -> str | None:
    """Why `chars` characters of text (a prompt, a conversation's contents) are refused, or None."""
    limit = max_text_chars(max_model_len)
    if chars <= limit:
        return None
    return (f"{chars} characters of text are more than this model's {max_model_len} tokens can hold "
            f"(at most {limit}: {CHARS_PER_TOKEN} per token)")


def ids_problem(n: int, max_model_len: int) -> str | None:
    """Why `n` token ids are refused, or None."""
    if n <= max_model_len:
        return None
    return f"{n} token ids are more than this model's length ({max_model_len})"


def messages_problem(n: int, max_model_len: int) -> str | None:
    """Why a conversation of `n` messages is refused, or None."""
    if n <= max_model_len:
        return None
    return f"{n} messages are more than this model's {max_model_len} tokens can hold"
