"""The prompt oracle, rerun against real nodes whose KV events carry a deployment secret
(`--events-secret-file`) behind a real `kvrt route` holding it: a local subscriber without the
secret gets no batch and no replay; the stream itself (read here by a holder, as a leak would
give it) names no block that the right prompts hash to under the published key root, 0 of N;
and the router, mapping prompts with the secret, still sends a prompt where its prefix is
cached, with and without a per-request cache_salt. A router without the secret routes without
cache affinity."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import numpy as np
import pytest
import zmq

from kvrt.ipc.ports import free_port, free_port_pair
from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.cache.events import TOPIC, KVEventView, seq_bytes
from kvrt.runtime.cache.keys import BlockHasher
from tests.launched import SMALL, launched_together
from tests.runtime.http.test_http import _wait_healthy
from tests.runtime.router.test_router import MODEL, _health, _wait_cached, routing

pytestmark = pytest.mark.e2e
GUESSES = 8  # prompts the attacker guesses right
SILENCE_S = 1.0  # what a refused subscriber is given to show it got nothing (no answer is the outcome)


def _complete(base: str, prompt: list[int], salt: str | None = None) -> tuple[str, int]:
    """POST /v1/completions through the router; (the backend that answered, cached tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers["x-kvrt-backend"], json.load(r)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _info(url: str) -> dict:
    with urllib.request.urlopen(url + "/kvrt/cache", timeout=10) as r:
        return json.load(r)


def test_without_the_secret_the_events_are_no_prompt_oracle_and_the_router_still_routes_by_cache(node, tmp_path):
    path = tmp_path / "events.secret"
    path.write_text(os.urandom(32).hex())
    os.chmod(path, 0o600)
    secret = EventSecret.load(str(path))
    http = [free_port(), free_port()]
    ctx = zmq.Context()
    with launched_together(*((name, tmp_path / name, (*SMALL, "--num-gpu-blocks", "128", "--http-port", str(h),
                                                      "--kv-events-port", str(free_port_pair()),
                                                      "--events-secret-file", str(path)), 0)
                             for name, h in zip((node + "a", node + "b"), http))):
        urls = [f"http://127.0.0.1:{h}" for h in http]
        for h in http:
            _wait_healthy(h)
        infos = [_info(u) for u in urls]
        assert all(i["kv_events_curve_key"] == secret.server_public.decode() for i in infos)
        outsider = ctx.socket(zmq.SUB)  # on the same machine, with everything /kvrt/cache tells
        outsider.setsockopt(zmq.LINGER, 0)
        outsider.setsockopt(zmq.SUBSCRIBE, TOPIC)
        asks = []
        for i in infos:
            outsider.connect(i["kv_events"])
            ask = ctx.socket(zmq.DEALER)
            ask.setsockopt(zmq.LINGER, 0)
            ask.connect(i["kv_events_replay"])
            ask.send_multipart([b"", seq_bytes(1)])
            asks.append(ask)
        leak = [KVEventView(i["kv_events"], i["kv_events_replay"], ctx, secret) for i in infos]
        rng = np.random.default_rng(11)
        prompts = [rng.integers(0, 512, 64).tolist() for _ in range(GUESSES)]
        with routing(urls, "cache-aware", "--events-secret-file", str(path)) as ca, \
                routing(urls, "cache-aware") as blind:
            landed = [_complete(ca, p + [1, 2, 3])[0] for p in prompts]
            for u in urls:
                _wait_cached(ca, u, landed.count(u) * 64 // 8)
            for p, where in zip(prompts, landed):  # affinity: each prompt's node, from its cache
                assert _complete(ca, p + [4, 5]) == (where, 64)
            where, cached = _complete(ca, prompts[0] + [6], salt="tenant-a")
            assert cached == 0  # a salt shares no block with the unsalted prompt
            _wait_cached(ca, where, landed.count(where) * 64 // 8 + 64 // 8)
            for _ in range(2):
                assert _complete(ca, prompts[0] + [7], salt="tenant-a") == (where, 64)
            assert [b["cached_blocks"] for b in _health(blind)["backends"]] == [None, None]
        deadline = time.monotonic() + 10
        while sum(len(v.media) for v in leak) < (GUESSES + 1) * 64 // 8:
            for v in leak:
                v.poll(20)
            assert time.monotonic() < deadline, "the holder's views did not see the blocks"
        published = set().union(*(v.media for v in leak))
        guesses = [BlockHasher(8, bytes.fromhex(infos[0]["key_root"])).update(p) for p in prompts]
        right = sum(all(k in published for k in keys) for keys in guesses)
        assert right == 0 and not {k for keys in guesses for k in keys} & published, \
            "a guessed prompt's keys match the published ones"
        assert sum(max(v.prefix(keys) for v in leak) == 8 for keys in guesses) == GUESSES  # the holder maps all
        assert not outsider.poll(int(SILENCE_S * 1000)), "a subscriber without the secret got a batch"
        assert not any(a.poll(10) for a in asks), "a replay socket answered a subscriber without the secret"
        for s in (outsider, *asks):
            s.close(0)
        for v in leak:
            v.close()
    ctx.term()
