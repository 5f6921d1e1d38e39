"""A chat template's render is bounded (runtime/client/chat_template.py): a template that loops
(with or without writing), writes or builds a value past the size bound, or fails in any way
is a ChatTemplateError naming why, never a hang, a huge allocation or another exception; an
assistant turn with a null content renders as "" (vLLM's way); and a real template renders
exactly as jinja2's own sandbox renders it (the oracle) under the bounds."""
from __future__ import annotations

import jinja2.sandbox
import pytest

from kvrt.runtime.client.chat_template import ChatTemplate, ChatTemplateError, Message
from tests.tokenizer_kit import QWEN25_TEMPLATE

CALLED = Message("assistant", None, [{"type": "function", "function": {"name": "now", "arguments": {}}}])
HI = [Message("user", "hi"), CALLED, Message("tool", "noon", tool_call_id="c1")]


@pytest.mark.parametrize("source, why", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran longer"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% set n = b|string|length %}{% endfor %}{% endfor %}",
     "ran longer"),  # (work that writes nothing: only the time bound can stop it, however fast the machine)
    ("{% for a in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "writes more"),
    ("{{ 'a' * 1000000000 }}", "more than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "more than"),
    ("{{ 'x'|center(1000000000) }}", "width"), ("{{ 'x'.ljust(1000000000) }}", "more than"),
    ("{{ '%1000000000d' % 1 }}", "width"), ("{{ '{:>1000000000}'.format(1) }}", "width"),
    ("{{ '%*d' % (5, 1) }}", "width"), ("{{ 2 ** 100000000 }}", "more than"),
    ("{{ 'ab'|replace('', 'y' * 60000) }}", "more than"), ("{{ messages|tojson(indent=1000000000) }}", "width"),
    ("{{ messages[0].content + 1 }}", "TypeError"), ("{{ messages[9].content }}", "failed"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ raise_exception('no tools here') }}", "no tools here"), ("{% if %}", "does not compile"),
])
def test_a_template_past_its_bounds_or_failing_is_a_chat_template_error(source, why):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, max_chars=100_000, time_limit_s=0.5).render(HI)
    assert why in str(e.value), str(e.value)


def test_a_real_template_renders_as_jinja2s_sandbox_renders_it_and_a_null_content_as_empty():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(QWEN25_TEMPLATE)
    msgs = [Message("system", "be brief"), *HI, Message("user", "héllo " * 500)]
    want = plain.render(messages=[{**m.to_dict(), "content": m.content or ""} for m in msgs],
                        add_generation_prompt=True, tools=None, documents=None)
    assert ChatTemplate(QWEN25_TEMPLATE, max_chars=len(want)).render(msgs) == want
    with pytest.raises(ChatTemplateError):
        ChatTemplate(QWEN25_TEMPLATE, max_chars=len(want) - 1).render(msgs)
    qwen3_way = "{% for m in messages %}{{ '</think>' in m.content }}{{ m.content.split('x')[0] }}{% endfor %}"
    assert ChatTemplate(qwen3_way).render(HI) == "FalsehiFalseFalsenoon"
