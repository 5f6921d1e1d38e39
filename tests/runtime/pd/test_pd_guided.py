"""Guided decoding across a prefill/decode split: P samples the first token inside the grammar,
D compiles the same grammar and moves its state past that token before it decodes, so the
answer, split across two nodes, is text the regex accepts (a D that began from the grammar's
start would write a second beginning after P's first token)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import Sampling
from kvrt.runtime.client.tokenizer import HFTokenizer
from tests.hfkit import make_checkpoint
from tests.launched import launched_together, pd_secret_file
from tests.runtime.pd.test_pd import pd_node  # noqa: F401 (the fixture)
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = pytest.mark.e2e
REGEX = "(yes|no), [0-9]{2}"


def test_a_guided_answer_split_over_p_and_d_follows_its_grammar(pd_node, tmp_path):  # noqa: F811
    directory = tmp_path / "qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=7, vocab_size=320)
    make_tokenizer_dir(directory)
    tok = HFTokenizer.from_dir(str(directory))
    common = ("--model", str(directory), "--block-size", "8", "--pd-transport", "shm",
              "--pd-secret-file", pd_secret_file(tmp_path))
    port = free_port()
    with launched_together((pd_node + "d", tmp_path / "d", ("--role", "decode", *common), port),
                           (pd_node + "p", tmp_path / "p", ("--role", "prefill", "--decode-peer",
                                                            f"tcp://127.0.0.1:{port}", *common), 0)) as (d, p):
        prompt = np.array(tok.encode("the quick brown fox"), np.int64)
        for seed in range(6):
            r = p.client.generate(prompt, 16, eos_token_id=tok.eos_token_ids[0],
                                  sampling=Sampling(temperature=1.0, seed=seed,
                                                    guided={"kind": "regex", "spec": REGEX}))
            text = tok.decode(r.output_token_ids[:-1])
            assert r.finish_reason == "eos" and re.fullmatch(REGEX, text), (seed, text, p.logs() + d.logs())
        stats = p.idle_stats()
        assert stats["pd_sent_bytes"] > 0 and stats["failed_requests"] == 0
