"""`--chat-template`: a file or the template itself, read as vLLM reads its flag.

Why vLLM's rule: the same command line must mean the same template. A value naming a file is
that file; one that does not, but holds a template's characters (braces, a newline), is the
template; anything else is a path that is not there, which is an error rather than a one-word
template.
"""
from __future__ import annotations

import os

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is a few KiB; a file far larger is not one


def read_chat_template(value: str) -> str:
    """The template `value` stands for, compiled once here so that a broken one stops the start
    rather than every chat request; ValueError naming the flag when it cannot be read or compiled."""
    from kvrt.runtime.client.chat_template import ChatTemplate, ChatTemplateError

    text = _read(value)
    try:
        ChatTemplate(text, {})
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return text


def _read(value: str) -> str:
    if os.path.isfile(value):
        if os.path.getsize(value) > MAX_TEMPLATE_BYTES:
            raise ValueError(f"--chat-template {value}: larger than {MAX_TEMPLATE_BYTES} bytes: not a chat template")
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value}: no such file (and not a template: it has no braces)")
