"""What a user does with a downloaded checkpoint: `kvrt launch --model DIR`, then `kvrt generate
--chat "..."`. The answer is the dense reference's greedy answer to the chat-templated prompt,
found through the node's own tokenizer, template and EOS ids, with the prefix cache serving the
second turn's shared prefix."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.tokenizer import HFTokenizer
from tests.conftest import REPO
from tests.hfkit import greedy, make_checkpoint
from tests.launched import launched
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = pytest.mark.e2e

NEW = 12


def _expected(ck, tok: HFTokenizer, question: str) -> tuple[list[int], list[int]]:
    text = ChatTemplate(tok.chat_template, tok.special_tokens).render([Message("user", question)])
    prompt = tok.encode(text, add_special_tokens=False)
    out = greedy(ck, prompt, NEW)
    for i, t in enumerate(out):  # the node stops at the first of the model's EOS ids
        if t in tok.eos_token_ids:
            return prompt, out[:i + 1]
    return prompt, out


def test_generate_chat_against_a_checkpoint_gives_the_reference_answer(node, tmp_path):
    directory = tmp_path / "qwen2"
    ck = make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    tok = HFTokenizer.from_dir(str(directory))
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "128") as ln:
        for question in ("What is a KV cache?", "What is a KV cache for?"):
            prompt, want = _expected(ck, tok, question)
            r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "generate", "--port", str(ln.port), "--chat",
                                question, "--max-new-tokens", str(NEW), "--json"],
                               cwd=REPO, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr + ln.logs()
            out = json.loads(r.stdout)
            assert out["output_token_ids"] == want
            assert out["text"] == tok.decode([t for t in want if t not in tok.eos_token_ids])
        assert sum(out["cached_tokens"].values()) > 0, "the second turn shares the chat template's prefix"
