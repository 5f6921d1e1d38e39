"""How many log-probabilities an answer may carry, checked before its requests are sent.

Why: an answer's size is the request's choice. Every choice (prompts x `n`) carries its prompt's
`prompt_logprobs` (the token and up to 20 alternatives at each position) and each output token's
`logprobs` with their alternatives; four prompts of 4,000 tokens with `n` 16 and
`prompt_logprobs` 20 asked for 5.4 million entries, 350 MiB of JSON. The engine's work for it is
modest (each prompt is scored once); what the server would write is not. So an answer may carry
at most `max_answer_entries` entries, at least one prompt of the model's full length scored with
every alternative; past it the request is a 400 that names the limit and what to lower.
Answers under it are still written as they are made (runtime/http/json_stream.py).
"""
from __future__ import annotations

from kvrt.runtime.client.api import MAX_TOP_LOGPROBS

MAX_ENTRIES = 1 << 20  # log-probabilities one answer may carry (about 70 MiB of JSON at most)
BIG_ANSWER = 4096      # entries past which a non-streamed answer is written as it is made


def max_answer_entries(max_model_len: int) -> int:
    """The most log-probability entries (a token's, or one alternative's) an answer may carry."""
    return max(MAX_ENTRIES, max_model_len * (MAX_TOP_LOGPROBS + 1))


def answer_entries(prompt_lens: list[int], n: int, max_tokens: int, prompt_k: int | None,
                   output_k: int | None, echo_k: int | None = None) -> int:
    """The log-probability entries an answer to these prompts can carry at most: per choice its
    prompt's scores (`prompt_k` alternatives, None: not asked), its output's (`output_k`), and,
    echoed with the completions' logprobs, its prompt's again (`echo_k`)."""
    per_prompt = 0
    if output_k is not None:
        per_prompt += max_tokens * (output_k + 1)
    total = len(prompt_lens) * n * per_prompt
    for k in (prompt_k, echo_k):
        if k is not None:
            total += n * sum(prompt_lens) * (k + 1)
    return total


def answer_problem(entries: int, max_model_len: int) -> str | None:
    """Why an answer of `entries` entries is refused, or None."""
    limit = max_answer_entries(max_model_len)
    if entries <= limit:
        return None
    return (f"the answer would carry up to {entries} log-probabilities (prompts x n x their tokens x the "
            f"alternatives asked, for prompt_logprobs and logprobs): at most {limit} are served; ask for fewer "
            f"choices (n), prompts, tokens or alternatives")
