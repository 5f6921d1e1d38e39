"""The request fields vLLM's OpenAI server accepts that ask nothing of kvrt at some values: the
values kvrt takes, and why it refuses the others.

Why a table: clients written for vLLM (the openai client, guidellm, aiperf, vLLM's own benchmark
client, LangChain) send these fields at their defaults on every request; a 400 for a default
stopped them all. A value that asks for something kvrt does not do is still refused, by name,
with the reason: a 200 always did what the request asked. A field in no table (of the request
models in runtime/http/openai_schema.py or here) with a value is refused as before; null is
always taken (it asks for the default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Accepted:
    takes: Callable[[Any], bool]  # the values kvrt takes
    why: str                      # what another value asks that kvrt does not do


def _is(*values: Any) -> Callable[[Any], bool]:
    """Exactly these values (a bool is not an int here: `True` is not `1`)."""
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _any(_v: Any) -> bool:
    return True


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


FIELDS: dict[str, Accepted] = {
    # they ask nothing of the answer whatever their value: who the end user is, tags, ids, hints
    "user": Accepted(_any, ""),
    "metadata": Accepted(_any, ""),
    "safety_identifier": Accepted(_any, ""),
    "prompt_cache_key": Accepted(_any, ""),  # a routing hint; kvrt's prefix cache needs none
    "request_id": Accepted(_any, ""),
    "parallel_tool_calls": Accepted(_any, ""),  # every call an answer makes is read; a forced answer is one
    "return_token_ids": Accepted(_any, ""),  # kvrt's answers always carry token_ids
    # at their defaults
    "priority": Accepted(_is(0), "kvrt schedules first come, first served: only priority 0"),
    "use_beam_search": Accepted(_is(False), "kvrt has no beam search"),
    "length_penalty": Accepted(_is(1.0, 1), "length_penalty applies to beam search, which kvrt does not do"),
    "best_of": Accepted(_is(1), "kvrt does not rank candidates: use n"),
    "continue_final_message": Accepted(_is(False), "kvrt's chat always starts a new assistant turn"),
    "store": Accepted(_is(False), "kvrt stores no completions"),
    "echo": Accepted(_is(False), "chat answers do not repeat the conversation (completions' echo does)"),
    "service_tier": Accepted(_is("auto", "default"), "kvrt has one service tier"),
    "top_a": Accepted(_is(0, 0.0), "kvrt has no top-a sampling (top_k, top_p, min_p are there)"),
    "spaces_between_special_tokens": Accepted(_is(True), "kvrt decodes special tokens as the tokenizer does"),
    "include_reasoning": Accepted(_is(True), "reasoning is split by --reasoning-parser, never dropped"),
    "return_tokens_as_token_ids": Accepted(_is(False), "logprobs name tokens by their text"),
    "truncate_prompt_tokens": Accepted(_is(-1), "kvrt does not truncate prompts: a prompt over the model's "
                                       "length is refused"),
    "allowed_token_ids": Accepted(_empty, "use logit_bias to ban or favour tokens"),
    "bad_words": Accepted(_empty, "use logit_bias to ban tokens"),
    "logits_processors": Accepted(_empty, "kvrt runs no request-supplied code"),
    "mm_processor_kwargs": Accepted(_empty, "kvrt serves text-only models"),
    "modalities": Accepted(_is(["text"]), "kvrt answers text only"),
    "documents": Accepted(_empty, "pass documents in the messages"),
    "chat_template": Accepted(_empty, "the server's chat template is fixed (kvrt launch --chat-template)"),
    "kv_transfer_params": Accepted(_empty, "kvrt's P/D handoff is its own (--role prefill/decode)"),
    "vllm_xargs": Accepted(_empty, "kvrt has no extra arguments"),
    "prompt_embeds": Accepted(_empty, "kvrt takes prompts as text or token ids"),
    "suffix": Accepted(_empty, "kvrt has no fill-in-the-middle"),
    "functions": Accepted(_empty, "functions is OpenAI's old name for tools: use tools"),
    "function_call": Accepted(_is("none"), "function_call is OpenAI's old name for tool_choice: use tool_choice"),
    # SGLang's, at the values that ask nothing beyond what kvrt does (its router sets them on every request)
    "no_stop_trim": Accepted(_is(False), "stop strings are trimmed from the text"),
    "return_hidden_states": Accepted(_is(False), "kvrt returns no hidden states"),
}


def refusal(name: str, value: Any) -> str | None:
    """Why the field `name` at `value` is refused, or None when kvrt takes it."""
    if value is None:
        return None
    row = FIELDS.get(name)
    if row is None:
        return f"{name} is not supported by this server"
    if row.takes(value):
        return None
    return f"{name}: {_show(value)} is not supported by this server ({row.why})"


def _show(value: Any) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
