"""`kvrt generate --text/--chat` with a Hugging Face tokenizer: the node tells the client its
model directory (InfoReply.model_dir), the client loads the tokenizer from there (or from
--tokenizer DIR), renders the chat template, streams the answer as text and stops at any of
the model's EOS ids. A scripted ZeroMQ node in a thread plays the engine (real sockets, the
real command in a subprocess); a real node with a real checkpoint is the model's tests' job."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import msgpack
import numpy as np
import pytest

from kvrt.ipc.config import NodeConfig
from kvrt.runtime.client.api import (API, CancelRequest, FinishedEvent, GenerateRequest, InfoReply, InfoRequest, TokenEvent)
from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.client import Sampling
from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.runtime.engine.client_api import ClientApi
from tests.conftest import REPO
from tests.launched import SMALL, launched
from tests.router_thread import RouterThread
from tests.tokenizer_kit import make_tokenizer_dir

MULTI = "héllo 世界 🙂"


class ScriptedNode(RouterThread):
    """Answers InfoRequest with `model_dir` and `vocab_size`; streams `script` for every request:
    finishes "eos" at the request's eos id, "stop" at one of its stop token ids, "length" at
    max_new_tokens, and otherwise waits for the client's CancelRequest (then "cancelled", with
    every token it sent)."""

    def __init__(self, script: list[int], model_dir: str = "", vocab_size: int = 1000):
        self.script, self.model_dir, self.vocab_size = script, model_dir, vocab_size
        self._sent: dict[str, list[int]] = {}
        super().__init__()
        self._start()

    def requests(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, data = self.sock.recv_multipart()
            msg = API.decode(data)
            self.received.append(msg)
            if isinstance(msg, InfoRequest):
                self._send(ident, InfoReply(msg.nonce, "scripted", "mixed", self.vocab_size, 4096, 16, -1,
                                            model_dir=self.model_dir))
            elif isinstance(msg, GenerateRequest):
                self._run(ident, msg)
            elif isinstance(msg, CancelRequest) and msg.request_id in self._sent:
                self._finish(ident, msg.request_id, "cancelled", len(self._sent[msg.request_id]))

    def _run(self, ident: bytes, msg: GenerateRequest) -> None:
        out = self._sent[msg.request_id] = []
        for tok in self.script[:msg.max_new_tokens]:
            out.append(tok)
            self._send(ident, TokenEvent(msg.request_id, len(out) - 1, [tok]))
            if tok == msg.eos_token_id:
                return self._finish(ident, msg.request_id, "eos", len(out))
            if tok in msg.stop_token_ids:
                return self._finish(ident, msg.request_id, "stop", len(out))
        if len(out) == msg.max_new_tokens:
            self._finish(ident, msg.request_id, "length", len(out))

    def _finish(self, ident: bytes, rid: str, reason: str, n: int) -> None:
        out = self._sent.pop(rid)
        self._send(ident, FinishedEvent(rid, np.array(out, dtype=np.int32), reason, 3, computed_prompt_tokens=3))



def kvrt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", "generate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> HFTokenizer:
    return HFTokenizer.from_dir(tok_dir)


@pytest.mark.e2e
def test_chat_uses_the_nodes_tokenizer_and_template(tok, tok_dir):
    im_end = tok.eos_token_ids[0]
    answer = tok.encode(MULTI)
    with ScriptedNode(answer + [im_end, 5, 6], model_dir=tok_dir) as node:
        r = kvrt("--port", str(node.port), "--chat", "hi there", "--system", "Be brief.", "--max-new-tokens", "20")
        assert r.returncode == 0, r.stderr
        assert r.stdout == MULTI + "\n" and "[eos]" in r.stderr  # the EOS token itself prints nothing
        req = node.requests()[0]
        text = ChatTemplate(tok.chat_template, tok.special_tokens).render(
            [Message("system", "Be brief."), Message("user", "hi there")])
        assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
                        "<|im_start|>assistant\n")
        assert req.prompt.tolist() == tok.encode(text, add_special_tokens=False)  # no special token added twice
        assert req.eos_token_id == im_end
        r = kvrt("--port", str(node.port), "--chat", "hi", "--max-new-tokens", "20", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == MULTI and out["output_token_ids"] == answer + [im_end]
        assert out["finish_reason"] == "eos"


@pytest.mark.e2e
def test_every_eos_id_stops_the_request(tok, tok_dir):
    """generation_config.json lists two EOS ids: the engine gets the first as its EOS and the
    other as a stop token id."""
    im_end, eot = tok.eos_token_ids
    answer = tok.encode(MULTI)
    with ScriptedNode(answer + [eot] + tok.encode("more"), model_dir=tok_dir) as node:
        r = kvrt("--port", str(node.port), "--text", "hello", "--max-new-tokens", "50", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == MULTI and out["output_token_ids"] == answer + [eot]
        assert out["finish_reason"] == "stop"
        req = node.requests()[0]
        assert req.prompt.tolist() == tok.encode("hello")
        assert (req.eos_token_id, req.stop_token_ids) == (im_end, [eot]) and req.temperature == 0.0
        r = kvrt("--port", str(node.port), "--text", "hello", "--max-new-tokens", "50", "--eos", str(eot))
        assert r.returncode == 0 and r.stdout == MULTI + "\n" and "[eos]" in r.stderr
        assert (node.requests()[1].eos_token_id, node.requests()[1].stop_token_ids) == (eot, [])


@pytest.mark.e2e
def test_stop_strings_cut_the_text_and_cancel(tok, tok_dir):
    """A stop string is text: the client finds it in the detokenized stream (even split over
    tokens), prints what comes before it and cancels the request."""
    script = tok.encode("hello wörld 🙂 and more")
    with ScriptedNode(script, model_dir=tok_dir) as node:
        r = kvrt("--port", str(node.port), "--text", "x", "--max-new-tokens", "50", "--stop", "rld 🙂", "--stop",
                 "zzz", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == "hello wö" and out["finish_reason"] == "stop"
        assert tok.decode(out["output_token_ids"]).startswith("hello wörld 🙂")  # through the token that ended it
        assert any(isinstance(m, CancelRequest) for m in node.received)
        r = kvrt("--port", str(node.port), "--text", "x", "--max-new-tokens", "50", "--stop", "rld")
        assert r.returncode == 0 and r.stdout == "hello wö\n" and "[stop]" in r.stderr


@pytest.mark.e2e
def test_sampling_options_reach_the_request(tok, tok_dir):
    with ScriptedNode(tok.encode("ok"), model_dir=tok_dir) as node:
        r = kvrt("--port", str(node.port), "--chat", "hi", "--max-new-tokens", "2", "--temperature", "0.7",
                 "--top-p", "0.9", "--top-k", "5", "--min-p", "0.05", "--seed", "42")
        assert r.returncode == 0, r.stderr
        req = node.requests()[0]
        assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed) == (0.7, 0.9, 5, 0.05, 42)


@pytest.mark.e2e
def test_tokenizer_option_overrides_the_node(tok, tok_dir):
    with ScriptedNode(tok.encode("ok"), model_dir="") as node:  # a node that names no model directory
        r = kvrt("--port", str(node.port), "--text", MULTI, "--max-new-tokens", "2", "--tokenizer", tok_dir)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "ok\n" and node.requests()[0].prompt.tolist() == tok.encode(MULTI)


@pytest.mark.e2e
def test_reference_model_keeps_the_byte_tokenizer():
    with ScriptedNode(list("é!".encode())) as node:
        r = kvrt("--port", str(node.port), "--text", "é", "--max-new-tokens", "3")
        assert r.returncode == 0 and r.stdout == "é!\n"
        assert node.requests()[0].prompt.tolist() == [0xC3, 0xA9] and node.requests()[0].eos_token_id == -1
        r = kvrt("--port", str(node.port), "--chat", "hi", "--max-new-tokens", "3")
        assert r.returncode == 2 and "has no chat template" in r.stderr


@pytest.mark.e2e
def test_clear_errors(tok, tok_dir, tmp_path):
    with ScriptedNode([1], model_dir=str(tmp_path / "elsewhere")) as node:
        r = kvrt("--port", str(node.port), "--text", "hi", "--max-new-tokens", "3")
        assert r.returncode == 2 and "not a directory on this machine" in r.stderr and "--tokenizer" in r.stderr
    for bad in (5, "relative/dir", ["/x"]):  # what a node says is checked before it is used
        with ScriptedNode([1], model_dir=bad) as node:
            r = kvrt("--port", str(node.port), "--text", "hi", "--max-new-tokens", "3")
            assert r.returncode == 2 and "not an absolute path" in r.stderr, r.stderr
    with ScriptedNode([1], model_dir=tok_dir, vocab_size=50) as node:
        r = kvrt("--port", str(node.port), "--chat", "hi", "--max-new-tokens", "3")
        assert r.returncode == 2 and "outside the node's vocabulary 0..49" in r.stderr and tok_dir in r.stderr
        assert not node.requests()  # refused before anything was sent
    r = kvrt("--port", "5", "--text", "hi", "--system", "x", "--max-new-tokens", "3")
    assert r.returncode == 2 and "--system goes with --chat" in r.stderr
    r = kvrt("--port", "5", "--chat", "", "--max-new-tokens", "3")
    assert r.returncode == 2 and "empty" in r.stderr
    r = kvrt("--port", "5", "--prompt-ids", "1", "--stop", "x", "--max-new-tokens", "3")
    assert r.returncode == 2 and "--stop is text" in r.stderr
    r = kvrt("--port", "5", "--text", "a", "--stop", "", "--max-new-tokens", "3")
    assert r.returncode == 2 and "--stop: each stop string" in r.stderr


def test_info_reply_carries_the_model_dir_and_stays_compatible(tmp_path):
    """The engine reports its model directory; an InfoReply from a node that predates the field
    still decodes (as the reference model), and an older client ignores it."""
    got = []
    clients = types.SimpleNamespace(reply=lambda c, m: got.append(m))
    intake = types.SimpleNamespace(cfg=NodeConfig(node="n", model_dir=str(tmp_path)), clients=clients)
    ClientApi.on_info(intake, b"client", InfoRequest(7))
    assert got[0].model_dir == str(tmp_path) and got[0].nonce == 7
    assert API.decode(API.encode(got[0])) == got[0]
    old = {"t": "info_reply", "v": 1, "nonce": 1, "node": "n", "role": "mixed", "vocab_size": 512,
           "max_model_len": 64, "block_size": 4, "eos_token_id": -1}
    assert API.decode(msgpack.packb(old)).model_dir == ""
    body = msgpack.unpackb(API.encode(got[0]))
    assert body["model_dir"] == str(tmp_path) and set(old) <= set(body)  # what an older client reads is there


@pytest.mark.e2e
def test_client_sampling_against_a_real_node(node, tmp_path):
    """The client's Sampling reaches a real engine: seeded draws repeat, stop token ids end the
    request with "stop", and the same through `kvrt generate`."""
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64") as ln:
        hot = Sampling(temperature=5.0, top_k=50, seed=7)
        a = ln.client.generate([1, 2, 3], 8, sampling=hot).output_token_ids.tolist()
        assert ln.client.generate([1, 2, 3], 8, sampling=hot).output_token_ids.tolist() == a
        greedy = ln.client.generate([1, 2, 3], 8).output_token_ids.tolist()
        stop = ln.client.generate([1, 2, 3], 8, sampling=Sampling(stop_token_ids=[greedy[2]]))
        assert stop.finish_reason == "stop" and stop.output_token_ids.tolist() == greedy[:greedy.index(greedy[2]) + 1]
        r = kvrt("--port", str(ln.port), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--temperature", "5",
                 "--top-k", "50", "--seed", "7", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["output_token_ids"] == a, r.stderr
