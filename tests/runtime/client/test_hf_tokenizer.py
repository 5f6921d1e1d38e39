"""A Hugging Face checkpoint's tokenizer: tokenizer.json through the `tokenizers` library,
tokenizer_config.json (special tokens, add_bos_token, chat template), generation_config.json
(EOS ids), incremental detokenization, and chat templates rendered as Hugging Face renders them.
The tokenizer is trained in the test (tests/tokenizer_kit.py): CI has no network."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.client.chat_template import ChatTemplate, ChatTemplateError, Message
from kvrt.runtime.client.detokenizer import IncrementalDetokenizer
from kvrt.runtime.client.tokenizer import REPLACEMENT, ByteTokenizer, HFTokenizer, TokenizerError
from tests.tokenizer_kit import QWEN25_TEMPLATE, make_tokenizer_dir

MULTI = "héllo 世界 🙂"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> HFTokenizer:
    return HFTokenizer.from_dir(tok_dir)


# ---- encode / decode ---------------------------------------------------------------------------

def test_loads_vocabulary_specials_and_eos_list(tok):
    im_end, eot = tok.backend.token_to_id("<|im_end|>"), tok.backend.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == (im_end, eot)  # generation_config.json's list, in its order
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.vocab_size == 300 and tok.chat_template == QWEN25_TEMPLATE and tok.bos_token_id is None


def test_encode_is_the_trained_bpe_and_round_trips(tok):
    ids = tok.encode(MULTI)
    assert ids == tok.backend.encode(MULTI).ids and len(ids) < len(MULTI.encode())  # merges, not bytes
    assert tok.decode(ids) == MULTI
    assert tok.encode("<|im_start|>user")[0] == tok.backend.token_to_id("<|im_start|>")  # one special token
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=False) == "a<|im_end|>b"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_ids_outside_the_vocabulary_decode_as_replacement(tok):
    """A model's embedding table is often larger than its tokenizer; such ids must not vanish
    (the library drops them silently) nor raise (it raises for negative ones)."""
    h = tok.encode("hi")
    assert tok.decode(h + [300] + h) == f"hi{REPLACEMENT}hi"
    assert tok.decode([-1, 2 ** 40]) == REPLACEMENT * 2


# ---- incremental detokenization ----------------------------------------------------------------

def test_multibyte_split_across_tokens_never_prints_garbage(tok):
    ids = tok.encode(MULTI)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "the test needs a character split over tokens"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == MULTI
    assert not any(REPLACEMENT in p for p in pieces)
    assert "" in pieces  # the first half of "é" was held back


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.lists(st.integers(1, 4), max_size=12))
def test_streamed_pieces_equal_the_whole_decode(tok, text, cuts):
    ids = tok.encode(text)
    detok, pieces, i = IncrementalDetokenizer(tok), [], 0
    for c in cuts + [len(ids)]:
        pieces.append(detok.add(ids[i:i + c]))
        i += c
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    if REPLACEMENT not in text:
        assert not any(REPLACEMENT in p for p in pieces)


def test_detokenizer_in_the_prompts_context(tok):
    prompt = tok.encode("hello ")
    out = tok.encode("wörld 🙂")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join([detok.add([t]) for t in out] + [detok.flush()]) == "wörld 🙂"


def test_detokenizer_skips_special_tokens_and_ends_an_unfinished_character(tok):
    im_end = tok.backend.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok") + [im_end]) == "ok"
    byte_detok = IncrementalDetokenizer(ByteTokenizer())
    assert byte_detok.add(list("é".encode())[:1]) == ""
    assert byte_detok.flush() == REPLACEMENT  # the stream ended inside the character


# ---- configuration files -----------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [(2, (2,)), ([2, 0, 2], (2, 0)), (None, ())])
def test_eos_from_generation_config(tmp_path, value, want):
    d = make_tokenizer_dir(tmp_path / "t", eos_token_id=value)
    assert HFTokenizer.from_dir(d).eos_token_ids == want


def test_eos_falls_back_to_the_tokenizers_eos_token(tmp_path):
    t = HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "t", generation_config=False))
    assert t.eos_token_ids == (t.backend.token_to_id("<|im_end|>"),)


@pytest.mark.parametrize("value", ["2", True, [1, "x"], 300, -1, {"id": 2}])
def test_bad_eos_is_a_clear_error(tmp_path, value):
    d = make_tokenizer_dir(tmp_path / "t", eos_token_id=value)
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        HFTokenizer.from_dir(d)


def test_bos_from_post_processor_and_add_bos_token(tmp_path):
    """Llama 3's tokenizer.json post-processor puts <|begin_of_text|> first; an explicit
    add_bos_token decides (as Llama-family tokenizers rebuild their post-processor from it)."""
    bos = "<|begin_of_text|>"
    t = HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "a", bos=bos, config={"bos_token": {"content": bos}}))
    b = t.backend.token_to_id(bos)
    assert t.bos_token_id == b and t.special_tokens["bos_token"] == bos
    assert t.encode("hi")[0] == b and t.encode("hi", add_special_tokens=False)[0] != b
    assert t.decode(t.encode("hi")) == "hi"
    off = HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "b", bos=bos, config={"add_bos_token": False}))
    assert off.encode("hi") == off.encode("hi", add_special_tokens=False)
    on = HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "c", config={"bos_token": "<|endoftext|>",
                                                                        "add_bos_token": True}))
    assert on.encode("hi") == [on.backend.token_to_id("<|endoftext|>")] + on.encode("hi", add_special_tokens=False)


def test_missing_and_corrupt_files_are_clear_errors(tmp_path, tok_dir):
    with pytest.raises(TokenizerError, match="does not exist"):
        HFTokenizer.from_dir(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        HFTokenizer.from_dir(str(tmp_path / "empty"))
    d = make_tokenizer_dir(tmp_path / "bad")
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write('{"model": 42}')
    with pytest.raises(TokenizerError, match="not a usable tokenizer.json"):
        HFTokenizer.from_dir(d)
    d = make_tokenizer_dir(tmp_path / "badcfg")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: cannot read it as JSON"):
        HFTokenizer.from_dir(d)
    d = make_tokenizer_dir(tmp_path / "badtok", config={"eos_token": 5})
    with pytest.raises(TokenizerError, match="eos_token"):
        HFTokenizer.from_dir(d)


def test_chat_template_sources(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "a", chat_template=named)).chat_template == "D"
    assert HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "b", chat_template=None)).chat_template is None
    d = make_tokenizer_dir(tmp_path / "c", chat_template="old")
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("new")
    assert HFTokenizer.from_dir(d).chat_template == "new"  # newer saves keep it in its own file
    with pytest.raises(TokenizerError, match="chat_template"):
        HFTokenizer.from_dir(make_tokenizer_dir(tmp_path / "d", chat_template=7))


# ---- chat templates ----------------------------------------------------------------------------

QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


def test_qwen_chatml_rendering(tok):
    tpl = ChatTemplate(tok.chat_template, tok.special_tokens)
    assert tpl.render([Message("user", MULTI)]) == (
        f"{QWEN_SYSTEM}<|im_start|>user\n{MULTI}<|im_end|>\n<|im_start|>assistant\n")
    assert tpl.render([Message("system", "Be brief."), Message("user", "hi"), Message("assistant", "hello"),
                       Message("user", "bye")], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n")
    text = tpl.render([Message("user", "hi")])
    ids = tok.encode(text, add_special_tokens=False)
    start = tok.backend.token_to_id("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3 and tok.decode(ids, skip_special_tokens=False) == text


def test_qwen_tools_branch_uses_tojson_unescaped(tok):
    tool = {"type": "function", "function": {"name": "wetter", "description": "Größe <b>", "parameters": {}}}
    out = ChatTemplate(tok.chat_template).render([Message("user", "hi")], tools=[tool])
    assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in out and "Größe <b>" in out


LLAMA_LIKE = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'] | trim }} [/INST]
    {% else %}
 {{ message['content'] | trim }} {{ eos_token }}
    {% endif %}
{% endfor %}
{% generation %}{% if add_generation_prompt %}>{% endif %}{% endgeneration %}"""


def test_trim_and_lstrip_blocks_bos_eos_and_raise_exception():
    tpl = ChatTemplate(LLAMA_LIKE, {"bos_token": "<s>", "eos_token": "</s>"})
    # block tags on their own (indented) lines leave nothing behind, as in transformers
    assert tpl.render([Message("user", " hi "), Message("assistant", "yo"), Message("user", "x")]) == (
        "<s>\n[INST] hi [/INST]\n yo </s>\n[INST] x [/INST]\n>")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tpl.render([Message("user", "a"), Message("user", "b")])


def test_template_is_sandboxed_and_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([Message("user", "x")])
    with pytest.raises(ChatTemplateError):  # the immutable sandbox: a template cannot change its input
        ChatTemplate("{{ messages.append(1) }}").render([Message("user", "x")])
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ChatTemplate("x").render([])
    assert ChatTemplate("{{ messages | tojson }}").render([Message("user", "世界")]) == \
        json.dumps([{"role": "user", "content": "世界"}], ensure_ascii=False)
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}").render(
        [Message("user", "a"), Message("user", "b")]) == "a"  # loop controls, as transformers enables them
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([Message("user", "a")]).isdigit()


def test_sentencepiece_style_decoder_keeps_the_first_answer_tokens_space(tmp_path):
    """Llama-2/Mistral-style tokenizer.json (Metaspace): a sequence's first token decodes
    without its leading space, so the answer's first token is decoded in the prompt's context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    sp.train_from_iterator(["hello world héllo wörld"] * 20, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    d = tmp_path / "sp"
    d.mkdir()
    sp.save(str(d / "tokenizer.json"))
    t = HFTokenizer.from_dir(str(d))
    prompt = t.encode("hello")
    answer = t.encode("hello world")[len(prompt):]
    assert t.decode(answer) == "world"  # alone, the space is gone
    detok = IncrementalDetokenizer(t, prompt)
    assert "".join([detok.add([a]) for a in answer] + [detok.flush()]) == " world"


QWEN3_LIKE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{{- ns.last_query_index }}|{{ messages[1].content.split('</think>')[-1].lstrip('\\n') }}|
{{- enable_thinking is defined and enable_thinking is false }}"""


def test_qwen3_style_namespace_string_methods_and_extra_variables():
    """What Qwen3's template relies on: namespace() assignment, reversed slices, str methods,
    and a caller's extra variable (enable_thinking) - allowed by the sandbox, as in transformers."""
    msgs = [Message("user", "a"), Message("assistant", "<think>x</think>\nans"), Message("user", "b")]
    assert ChatTemplate(QWEN3_LIKE).render(msgs, enable_thinking=False) == "2|ans|True"
