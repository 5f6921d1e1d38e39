"""Log-probabilities in an answer, in the completions', chat's and vLLM's prompt shapes, as lists
made while the answer is written (runtime/http/json_stream.py's Lazy), each token's text decoded
once per server.

Why lazy: an answer's log-probabilities are an object per token and alternative, the bulk of a
large answer; made as they are written, the server holds a slice of them at a time rather than
all (runtime/http/answer_size.py bounds how many one answer may carry).
"""
from __future__ import annotations

from typing import Any, Iterator

from kvrt.runtime.client.tokenizer import Tokenizer
from kvrt.runtime.http.json_stream import Lazy


class TokenTexts:
    """Each token id's text as the answers show it (`decode([id])`), decoded once: the answers
    of a server name the same few thousand tokens again and again. At most one entry per id
    the engine can answer (the model's vocabulary)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tok.decode([token])
        return text


def completion_logprobs(text: TokenTexts, ids: list[int], lps: list[float | None], top: list[list | None],
                        prompt: list[int] | None = None, scores: tuple | None = None, echo: bool = False,
                        k: int = 0) -> dict:
    """The completions API's logprobs of some tokens: each chosen token's, and its alternatives
    (token text -> logprob) when asked. With `echo` and the prompt's `scores` (logprobs, ranks,
    top) the prompt's tokens come first, the first with null as it has nothing before it (as
    OpenAI and vLLM answer it), each with the request's `k` alternatives."""
    if echo and scores is not None:
        plps, _, ptop = scores
        gap = [None] * (len(prompt) - 1 - len(plps))  # (a request cancelled before its prompt was scored)
        alts = [[t[0][:k], t[1][:k]] for t in ptop] if k and ptop else [None] * len(plps)
        ids, lps, top = list(prompt) + list(ids), [None, *plps, *gap] + list(lps), [None, *alts, *gap] + list(top)
    return {"tokens": Lazy(text(t) for t in ids), "token_logprobs": lps,
            "top_logprobs": Lazy({text(a): lp for a, lp in zip(*t)} if t else None for t in top)
            if any(top) else None}


def prompt_logprobs(text: TokenTexts, prompt: list[int], scores: tuple | None, k: int | None) -> Lazy | None:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then for each token a map of
    token id -> {logprob, rank, decoded_token} holding the token itself and the k likeliest
    there. None when not asked (or not scored: a request cancelled first)."""
    if k is None or scores is None:
        return None
    return Lazy(_prompt_entries(text, prompt, scores, k))


def _prompt_entries(text: TokenTexts, prompt: list[int], scores: tuple, k: int) -> Iterator[Any]:
    lps, ranks, top = scores
    yield None
    for i, (lp, rank) in enumerate(zip(lps, ranks)):
        entry = {int(prompt[i + 1]): (lp, rank)}
        if k and top:
            for r, (a, alp) in enumerate(zip(top[i][0][:k], top[i][1][:k])):
                entry.setdefault(int(a), (alp, r + 1))
        yield {str(a): {"logprob": v, "rank": int(r), "decoded_token": text(a)} for a, (v, r) in entry.items()}


def chat_logprobs(text: TokenTexts, ids: list[int], lps: list[float | None], top: list[list | None]) -> dict:
    """The chat API's logprobs: each chosen token's, with its bytes and its alternatives."""
    def entry(t: int, lp: float | None) -> dict:
        s = text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": Lazy({**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in zip(*alt)] if alt else []}
                            for t, lp, alt in zip(ids, lps, top))}
