"""vLLM's request fields at their default (or no-op) values are accepted, on both endpoints, and
refused by name, with the reason, at a value that asks for what kvrt does not do; the full bodies
real clients written for vLLM send pass. A request that passes every check reaches the engine,
which here is a fake answering 503: a 503 is "accepted", a 400 "refused"."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.vllm_fields import FIELDS
from tests.runtime.http.test_http import MODEL, _FakeBridge
from tests.tokenizer_kit import make_tokenizer_dir

USER = [{"role": "user", "content": "hi"}]

# at their default or a value that asks nothing: accepted on completions and chat
DEFAULTS = {"add_special_tokens": None, "priority": 0, "use_beam_search": False, "continue_final_message": False,
            "store": False, "metadata": {"a": "b"}, "user": "u", "parallel_tool_calls": True, "service_tier": "auto",
            "top_a": 0, "length_penalty": 1.0, "best_of": 1, "spaces_between_special_tokens": True,
            "include_reasoning": True, "return_tokens_as_token_ids": False, "truncate_prompt_tokens": None,
            "allowed_token_ids": None, "bad_words": [], "request_id": "abc", "return_token_ids": True,
            "safety_identifier": "s", "prompt_cache_key": "k", "logits_processors": None, "kv_transfer_params": None,
            "vllm_xargs": None, "modalities": ["text"], "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": False}}
CHAT_DEFAULTS = {"add_generation_prompt": True, "add_special_tokens": False, "echo": False, "documents": None,
                 "chat_template": None, "reasoning_effort": "low", "mm_processor_kwargs": {}}
COMPLETION_DEFAULTS = {"add_special_tokens": True, "echo": False, "suffix": None}
# a value asking for what kvrt does not do: refused naming the field
REFUSED = {"priority": 1, "use_beam_search": True, "continue_final_message": True, "store": True,
           "service_tier": "flex", "top_a": 0.5, "length_penalty": 2.0, "best_of": 3,
           "spaces_between_special_tokens": False, "include_reasoning": False, "return_tokens_as_token_ids": True,
           "truncate_prompt_tokens": 8, "allowed_token_ids": [1, 2], "bad_words": ["x"], "modalities": ["audio"],
           "logits_processors": ["m.f"], "kv_transfer_params": {"x": 1}, "vllm_xargs": {"a": 1}, "suffix": "s",
           "functions": [{"name": "f"}], "chat_template": "{{ x }}", "documents": [{"t": "d"}],
           "mm_processor_kwargs": {"a": 1}, "prompt_embeds": "AAAA", "an_unknown_field": 1}


def _bridge() -> _FakeBridge:
    """The fake engine, with room for a rendered conversation."""
    bridge = _FakeBridge(True)
    bridge.info = dataclasses.replace(bridge.info, max_model_len=4096)
    return bridge


@pytest.fixture(scope="module")
def chat_client(tmp_path_factory):
    server = Server(_bridge(), MODEL)
    server._tokenizer = HFTokenizer.from_dir(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))
    with TestClient(create_app(server), raise_server_exceptions=False) as c:
        yield c


def _post(client, path: str, body: dict):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": USER} if path.endswith("chat/completions") else {"prompt": [1, 2]})
    return client.post(path, json={**base, **body})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fields_at_their_defaults_are_accepted(chat_client, path):
    extra = CHAT_DEFAULTS if "chat" in path else COMPLETION_DEFAULTS
    for name, value in {**DEFAULTS, **extra}.items():
        r = _post(chat_client, path, {name: value})
        assert r.status_code == 503, (path, name, value, r.text)
    r = _post(chat_client, path, {**DEFAULTS, **extra, "stream": True})  # all together, streamed
    assert r.status_code == 503, r.text


@pytest.mark.parametrize("name,value", sorted(REFUSED.items()))
def test_a_value_kvrt_does_not_do_is_refused_naming_the_field_and_why(chat_client, name, value):
    for path in ("/v1/completions", "/v1/chat/completions"):
        if name == "suffix" and "chat" in path:
            continue
        r = _post(chat_client, path, {name: value})
        assert r.status_code == 400, (path, name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and err["code"] == "unsupported_field" and name in err["message"], err
        if name in FIELDS:
            assert FIELDS[name].why in err["message"]


def test_chat_add_generation_prompt_and_add_special_tokens_change_the_prompt(tmp_path):
    """They are implemented, not only accepted: the prompt /tokenize counts follows them."""
    server = Server(_bridge(), MODEL)
    server._tokenizer = HFTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    with TestClient(create_app(server)) as c:
        def count(**kw):
            return c.post("/tokenize", json={"messages": USER, **kw}).json()["count"]

        _, with_prompt = asyncio.run(server.chat_prompt("", [_msg()], add_generation_prompt=True))
        _, without = asyncio.run(server.chat_prompt("", [_msg()], add_generation_prompt=False))
        assert len(with_prompt) > len(without) and count() == len(with_prompt)
        assert count(add_generation_prompt=False) == len(without)


def _msg():
    from kvrt.runtime.http.openai_schema import ChatMessage

    return ChatMessage(role="user", content="hi")


# the bodies real clients send (their own defaults included), mirrored from their request builders
CLIENT_BODIES = {
    # vLLM's `vllm bench serve`, backend openai (completions) and openai-chat
    "vllm-bench-completions": ("/v1/completions", {"model": MODEL, "prompt": "hello there", "repetition_penalty": 1.0,
                                                   "max_tokens": 4, "logprobs": None, "stream": True,
                                                   "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "vllm-bench-chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}], "max_completion_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}),
    # guidellm's openai_http backend: streamed with continuous usage, ignore_eos and a max_tokens pair
    "guidellm-completions": ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                                 "stop": None, "ignore_eos": True,
                                                 "stream": True, "stream_options": {"include_usage": True,
                                                                                    "continuous_usage_stats": True}}),
    "guidellm-chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}], "max_completion_tokens": 4, "stop": None,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}}),
    # aiperf's chat endpoint, streamed
    "aiperf-chat": ("/v1/chat/completions", {"messages": [{"role": "user", "name": "text", "content": "hello"}],
                                             "model": MODEL, "stream": True, "max_completion_tokens": 4,
                                             "stream_options": {"include_usage": True}}),
    # LangChain's ChatOpenAI.invoke / .stream
    "langchain-invoke": ("/v1/chat/completions", {"messages": [{"content": "hello", "role": "user"}], "model": MODEL,
                                                  "stream": False, "temperature": 0.0, "n": 1}),
    "langchain-stream": ("/v1/chat/completions", {"messages": [{"content": "hello", "role": "user"}], "model": MODEL,
                                                  "stream": True, "stream_options": {"include_usage": True},
                                                  "temperature": 0.0}),
    # the openai client's chat with its optional OpenAI fields set
    "openai-chat": ("/v1/chat/completions", {"messages": USER, "model": MODEL, "max_completion_tokens": 4,
                                             "metadata": {"k": "v"}, "store": False, "reasoning_effort": "low",
                                             "service_tier": "auto", "parallel_tool_calls": False, "user": "u",
                                             "seed": 1, "top_p": 1.0, "presence_penalty": 0.0,
                                             "frequency_penalty": 0.0, "logprobs": False, "n": 1}),
}


@pytest.mark.parametrize("client", sorted(CLIENT_BODIES))
def test_the_bodies_clients_written_for_vllm_send_are_accepted(chat_client, client):
    path, body = CLIENT_BODIES[client]
    r = chat_client.post(path, json=body)
    assert r.status_code == 503, r.text
