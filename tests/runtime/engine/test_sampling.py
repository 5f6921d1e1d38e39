"""Sampling through real nodes: the sampling parameters of a request travel with it (intake,
step batch, worker, the P->D handoff), and what comes back equals what the dense reference
model and the sampler compute in this process, so seeded answers are the same on every run and
whatever else the node runs. Stop token ids end a request with "stop"; logprobs are the model's
log-softmax; bad parameters are refused with a clear error and change nothing."""
from __future__ import annotations

import time
import uuid

import msgpack
import numpy as np
import pytest
import zmq

from kvrt.ipc.config import NodeConfig
from kvrt.runtime.client.api import API, BAD_REQUEST, ErrorEvent, FinishedEvent, GenerateRequest, TokenEvent
from kvrt.runtime.engine.intake import validate
from kvrt.runtime.pd.messages import PdAllocated, PdKvReady, PdPrealloc
from tests.conftest import leftovers
from tests.launched import SMALL, launched, oracle, shared_prefix_prompts
from tests.runtime.pd.test_pd import pd_node, pd_pair  # noqa: F401  (pd_node is a fixture)
from tests.runtime.pd.test_pd_security import decode, peer  # noqa: F401  (fixtures: a decode node, a hand-made P)
from kvrt.workers.model.sampler import SamplingRows, sample

WAIT_S = 60.0


class Socket:
    """A client socket that sends GenerateRequests with every field and collects the answers
    of each request (runtime/client/client.py sends greedy requests only)."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.events: dict[str, list] = {}

    def send(self, req: GenerateRequest | bytes) -> None:
        self.sock.send(req if isinstance(req, bytes) else API.encode(req))

    def until_end(self, rid: str) -> FinishedEvent | ErrorEvent:
        deadline = time.monotonic() + WAIT_S
        while True:
            for ev in self.events.get(rid, []):
                if isinstance(ev, (FinishedEvent, ErrorEvent)):
                    return ev
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no end of request {rid} within {WAIT_S:g} s")
            data = self.sock.recv()
            if data:
                ev = API.decode(data)
                self.events.setdefault(ev.request_id, []).append(ev)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def request(rid: str, prompt, new: int, **kw) -> GenerateRequest:
    return GenerateRequest(rid, np.asarray(prompt, np.int32), new, **kw)


def expected(prompt, new: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop=(), min_p=0.0,
             repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0) -> tuple[list, list]:
    """The tokens and logprobs a node must answer: the dense model's logits at each position,
    sampled here with the request's parameters, penalties (from the tokens so far, as the
    sampler's entries mean them) and (seed, position)."""
    model, seq, out, lps = oracle(), [int(t) for t in prompt], [], []
    for _ in range(new):
        z = model.dense_logits(np.array(seq, np.int32))[-1:]
        r = SamplingRows(np.array([temperature]), np.array([top_p]), np.array([top_k]), np.array([seed], np.uint64),
                         np.array([len(seq)]), np.array([True]), np.array([min_p]))
        ids = sorted(set(seq) if repetition_penalty != 1.0 else set(out))
        r.repetition, r.frequency, r.presence = (np.array([repetition_penalty]), np.array([frequency_penalty]),
                                                 np.array([presence_penalty]))
        r.pen_lens, r.pen_ids, r.pen_counts = np.array([len(ids)]), np.array(ids), np.array([out.count(t) for t in ids])
        tokens, lp = sample(z, r)
        out.append(int(tokens[0]))
        lps.append(float(lp[0]))
        seq.append(out[-1])
        if out[-1] in stop:
            break
    return out, lps


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    name = "s" + uuid.uuid4().hex[:10]
    with launched(name, tmp_path_factory.mktemp("logs"), *SMALL, "--num-gpu-blocks", "512") as node:
        yield node
    assert not leftovers(name)


@pytest.fixture
def sock(ln):
    s = Socket(ln.port)
    yield s
    s.close()


HOT = dict(temperature=2.5, top_p=0.95, top_k=100, min_p=0.02)  # flat enough that tokens differ between seeds
PEN = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)


@pytest.mark.e2e
def test_seeded_sampling_equals_the_reference_alone_and_in_any_batch(ln, sock):
    prompt = np.arange(7, 30)
    want, _ = expected(prompt, 10, seed=1234, **HOT)
    assert want != oracle().generate_dense(prompt, 10), "the parameters must make sampling visible"
    sock.send(request("alone", prompt, 10, seed=1234, **HOT))
    alone = sock.until_end("alone")
    # the same request among others, which arrive first and take different batch slots
    others = [np.arange(i, i + 40 + 7 * i) % 512 for i in range(5)]
    for i, p in enumerate(others):
        sock.send(request(f"o{i}", p, 12, seed=i, **HOT))
    sock.send(request("crowd", prompt, 10, seed=1234, use_cache=False, **HOT))
    sock.send(request("other-seed", prompt, 10, seed=99, **HOT))
    crowd, other = sock.until_end("crowd"), sock.until_end("other-seed")
    for i, p in enumerate(others):
        assert sock.until_end(f"o{i}").output_token_ids.tolist() == expected(p, 12, seed=i, **HOT)[0]
    assert alone.output_token_ids.tolist() == crowd.output_token_ids.tolist() == want
    assert other.output_token_ids.tolist() == expected(prompt, 10, seed=99, **HOT)[0] != want


@pytest.mark.e2e
def test_temperature_zero_is_greedy_whatever_the_other_parameters(ln, sock):
    prompt = np.arange(100, 140)
    sock.send(request("cold", prompt, 8, temperature=0.0, top_p=0.3, top_k=7, seed=5))
    assert sock.until_end("cold").output_token_ids.tolist() == oracle().generate_dense(prompt, 8)
    sock.send(request("k1", prompt, 8, temperature=1.0, top_k=1, seed=6))
    assert sock.until_end("k1").output_token_ids.tolist() == oracle().generate_dense(prompt, 8)


@pytest.mark.e2e
def test_stop_token_ids_end_the_request_with_stop(ln, sock):
    prompt = np.arange(50, 75)
    greedy = oracle().generate_dense(prompt, 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    sock.send(request("stop", prompt, 12, stop_token_ids=[stop, 511 if stop != 511 else 510]))
    end = sock.until_end("stop")
    assert end.finish_reason == "stop" and end.output_token_ids.tolist() == greedy[:cut]
    streamed = [t for ev in sock.events["stop"] if isinstance(ev, TokenEvent) for t in ev.token_ids]
    assert streamed == greedy[:cut]
    e = ln.idle_stats()
    assert e["device_used"] == 0 and e["seqs_running"] == 0


@pytest.mark.e2e
def test_logprobs_are_the_models_log_softmax(ln, sock):
    prompt = np.arange(200, 233)
    for rid, params in (("lp-greedy", {}), ("lp-hot", dict(seed=77, **HOT))):
        want, want_lp = expected(prompt, 6, **params)
        sock.send(request(rid, prompt, 6, logprobs=True, **params))
        end = sock.until_end(rid)
        assert end.output_token_ids.tolist() == want
        assert np.allclose(end.output_logprobs, want_lp, rtol=0, atol=1e-5), (end.output_logprobs, want_lp)
        streamed = [lp for ev in sock.events[rid] if isinstance(ev, TokenEvent) for lp in ev.logprobs]
        assert streamed == end.output_logprobs
    sock.send(request("no-lp", prompt, 3))
    end = sock.until_end("no-lp")
    assert end.output_logprobs == [] and all(ev.logprobs == [] for ev in sock.events["no-lp"]
                                             if isinstance(ev, TokenEvent))


BAD = [("temperature", "hot"), ("temperature", -0.5), ("temperature", float("nan")), ("temperature", True),
       ("temperature", 1e9), ("top_p", 0), ("top_p", 1.5), ("top_p", None), ("top_k", -1), ("top_k", 1.0),
       ("top_k", 513), ("seed", -1), ("seed", 1 << 63), ("seed", "7"), ("stop_token_ids", 5),
       ("stop_token_ids", [512]), ("stop_token_ids", [-1]), ("stop_token_ids", [True]),
       ("stop_token_ids", list(range(65))), ("logprobs", 1), ("min_p", -0.1), ("min_p", 1.5), ("min_p", None),
       ("min_p", True), ("cache_salt", 5), ("cache_salt", None), ("cache_salt", "x" * 257),
       ("cache_salt", "\ud800")]


@pytest.mark.parametrize("field,value", BAD)
def test_bad_sampling_parameters_are_refused_at_intake(field, value):
    req = request("r", [1, 2, 3], 4, **{field: value})
    problem = validate(req, NodeConfig(node="x"))
    assert problem.startswith(field), problem


@pytest.mark.e2e
def test_bad_sampling_parameters_are_refused_by_the_node(ln, sock):
    for i, (field, value) in enumerate(BAD[:12]):
        body = {"t": "generate", "v": 1, "request_id": f"bad{i}", "prompt": np.arange(3, dtype="<i4").tobytes(),
                "max_new_tokens": 4, field: value}
        sock.send(msgpack.packb(body, use_bin_type=True))
        ev = sock.until_end(f"bad{i}")
        assert isinstance(ev, ErrorEvent) and ev.code == BAD_REQUEST and ev.message.startswith(field), ev
    # a request without any sampling field (an older client) is greedy
    body = {"t": "generate", "v": 1, "request_id": "plain", "prompt": np.arange(3, 20, dtype="<i4").tobytes(),
            "max_new_tokens": 4}
    sock.send(msgpack.packb(body, use_bin_type=True))
    assert sock.until_end("plain").output_token_ids.tolist() == oracle().generate_dense(np.arange(3, 20), 4)


@pytest.mark.e2e
def test_pd_hands_the_sampling_parameters_to_decode(pd_node, tmp_path):  # noqa: F811
    """P samples the first token, D the rest: together they answer what one node answers."""
    prompt = np.arange(11, 60)
    want, want_lp = expected(prompt, 8, seed=4242, **HOT)
    stop_want, _ = expected(prompt, 8, seed=4242, stop=(want[3],), **HOT)
    with pd_pair(pd_node, tmp_path) as (p, d):
        s = Socket(p.port)
        try:
            s.send(request("pd", prompt, 8, seed=4242, logprobs=True, **HOT))
            s.send(request("pd-stop", prompt, 8, seed=4242, stop_token_ids=[want[3]], **HOT))
            s.send(request("pd-pen", prompt, 8, seed=4242, top_logprobs=3, **HOT, **PEN))
            s.send(request("pd-prompt", prompt, 8, prompt_logprobs=2))
            end, stopped, pen = s.until_end("pd"), s.until_end("pd-stop"), s.until_end("pd-pen")
            scored = s.until_end("pd-prompt")
            first = [ev for ev in s.events["pd-prompt"] if isinstance(ev, TokenEvent)][0]
        finally:
            s.close()
        assert isinstance(end, FinishedEvent), end
        assert end.output_token_ids.tolist() == want
        assert np.allclose(end.output_logprobs, want_lp, rtol=0, atol=1e-5)
        assert stopped.finish_reason == "stop" and stopped.output_token_ids.tolist() == stop_want
        pen_want = expected(prompt, 8, seed=4242, **HOT, **PEN)[0]
        assert pen.output_token_ids.tolist() == pen_want != want, "the penalties hold on P and D"
        assert len(pen.output_top) == 8 and all(len(ids) == len(lps) == 3 for ids, lps in pen.output_top)
        # P scores the prompt it prefills: in its first token's event and in D's answer it relays
        z = oracle().dense_logits(prompt.astype(np.int32))[:-1]
        z = z - z.max(-1, keepdims=True)
        lsm = (z - np.log(np.exp(z).sum(-1, keepdims=True)))[np.arange(len(z)), prompt[1:]]
        assert scored.output_token_ids.tolist() == oracle().generate_dense(prompt, 8)
        for ev in (first, scored):
            np.testing.assert_allclose(ev.prompt_logprobs, lsm, rtol=0, atol=1e-9)
            assert len(ev.prompt_ranks) == len(ev.prompt_top) == len(prompt) - 1
        assert p.idle_stats()["pd_sent_bytes"] > 0


@pytest.mark.e2e
def test_seeded_sampling_survives_swaps_and_preemption(node, tmp_path):
    """A pool too small for the requests at once: they are preempted, recomputed and swapped,
    and each still answers the tokens its (seed, position) draws give alone."""
    prompts = shared_prefix_prompts(seed=7)
    # 40 new tokens grow every request by 5 blocks: the running ones outgrow the pool, whatever
    # order the engine admits them in, so preemption is certain rather than a matter of timing
    pens = [PEN if i % 2 else {} for i in range(len(prompts))]  # penalties come from the tokens, not state
    want = [expected(p, 40, seed=i, **HOT, **pens[i])[0] for i, p in enumerate(prompts)]
    opts = (*SMALL, "--num-gpu-blocks", "40", "--num-cpu-blocks", "64", "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        s = Socket(ln.port)
        try:
            for i, p in enumerate(prompts):
                s.send(request(f"r{i}", p, 40, seed=i, **HOT, **pens[i]))
            got = [s.until_end(f"r{i}") for i in range(len(prompts))]
        finally:
            s.close()
        assert [g.output_token_ids.tolist() for g in got] == want, ln.logs()
        stats = ln.idle_stats()
        assert stats["preemptions"] > 0 and stats["device_used"] == 0


@pytest.mark.e2e
@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=2.0), dict(top_k="3"), dict(seed=-5),
                                 dict(stop_token_ids=[999]), dict(logprobs="yes")])
def test_a_peers_bad_sampling_parameters_are_refused(decode, peer, bad):  # noqa: F811
    peer.send(PdPrealloc("b", np.arange(1, 30, dtype=np.int32), 8, **bad))
    err = peer.recv()
    assert isinstance(err, ErrorEvent) and err.code == BAD_REQUEST and next(iter(bad)) in err.message, err
    assert decode.engine_stats()["device_used"] == 0


@pytest.mark.e2e
def test_a_peers_first_logprob_is_checked_and_kept(decode, peer):  # noqa: F811
    prompt = np.arange(1, 30, dtype=np.int32)
    peer.send(PdPrealloc("lp", prompt, 4, temperature=0.7, seed=3, logprobs=True))
    assert isinstance(peer.recv(), PdAllocated)
    peer.send(PdKvReady("lp", 5, first_logprob=0.5))  # a probability above 1
    err = peer.recv()
    assert isinstance(err, ErrorEvent) and err.code == BAD_REQUEST and "first_logprob" in err.message, err
    peer.send(PdKvReady("lp", 5, first_logprob=-1.25))
    while not isinstance(end := peer.recv(), FinishedEvent):
        assert isinstance(end, TokenEvent) and len(end.logprobs) == len(end.token_ids), end
    assert end.output_token_ids[0] == 5 and len(end.output_logprobs) == 4 and end.output_logprobs[0] == -1.25
    assert all(lp < 0 for lp in end.output_logprobs[1:])


def test_a_sequence_bans_its_stops_before_min_tokens_and_counts_its_tokens_for_penalties():
    from kvrt.runtime.engine.sequence import Sequence

    seq = Sequence.new("p", np.array([5, 6, 5, 9], np.int32), 8, 4, eos_token_id=2, stop_token_ids=frozenset({3}),
                       min_tokens=2, logit_bias={7: 1.5}, frequency_penalty=0.5)
    assert seq.bias() == {7: 1.5, 2: -np.inf, 3: -np.inf}
    for t in (6, 8, 6):
        seq.append(t)
    assert seq.bias() == {7: 1.5}
    ids, counts = seq.penalty_counts()
    assert dict(zip(ids.tolist(), counts.tolist())) == {6: 2, 8: 1}  # the output only
    seq.repetition_penalty = 1.3  # covers the prompt: its other tokens with count 0
    ids, counts = seq.penalty_counts()
    assert dict(zip(ids.tolist(), counts.tolist())) == {6: 2, 8: 1, 5: 0, 9: 0}
