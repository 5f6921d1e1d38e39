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
    """The template `value` stands for; ValueError naming the flag when it cannot be read."""
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
