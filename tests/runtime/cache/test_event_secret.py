"""The KV events' deployment secret, over real ZeroMQ sockets: only its holders are admitted
(a plain subscriber, or one with another secret, gets no batch and no replay), the published
keys are the keyed hash of the cache's keys (vLLM's decoder still reads them), and the prompt
oracle fails: hashing the right prompts under the published root matches none of them, while the
holder's view finds every one. The rule that events beyond loopback need a secret is checked too."""
from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import pytest
import zmq

from kvrt.ipc.ports import free_port_pair
from kvrt.runtime.cache.event_secret import EventSecret, is_loopback, needs_secret, read_secret
from kvrt.runtime.cache.events import END_OF_REPLAY, GPU, TOPIC, CachedBlock, KVEventPublisher, KVEventView, seq_bytes
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.node.config import ConfigError, NodeConfig
from tests.runtime.cache.test_kv_events import vllm_structs

ROOT = NodeConfig(node="n").key_root
WAIT_MS = 300  # what a refused subscriber is given to show it got nothing (no answer is the outcome)


def _secret_file(tmp_path, text: bytes = b"0123456789abcdef0123456789abcdef", mode: int = 0o600) -> str:
    path = tmp_path / "events.secret"
    path.write_bytes(text + b"\n")
    os.chmod(path, mode)
    return str(path)


def test_the_secret_file_is_checked_and_gives_stable_keys(tmp_path):
    good = _secret_file(tmp_path)
    assert read_secret(good) == b"0123456789abcdef0123456789abcdef"
    assert EventSecret.load(good) == EventSecret.of(read_secret(good))  # both ends derive the same keys
    x = EventSecret.of(b"x" * 16)
    assert x.publish(ROOT) == hashlib.blake2b(ROOT, digest_size=16, key=x.salt_key).digest() == x.publish(ROOT)
    assert x.publish(ROOT) != EventSecret.of(b"y" * 16).publish(ROOT) and x.publish(ROOT) != ROOT
    shown = repr(EventSecret.of(b"x" * 16))  # a log line never holds a secret key
    assert not any(k.decode() in shown for k in (EventSecret.of(b"x" * 16).server_secret,
                                                  EventSecret.of(b"x" * 16).client_secret))
    with pytest.raises(ValueError, match="readable by other users"):
        read_secret(_secret_file(tmp_path, mode=0o644))
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(_secret_file(tmp_path, b"short"))
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(str(tmp_path / "missing"))


def test_events_beyond_loopback_need_the_secret(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert needs_secret("0.0.0.0") and needs_secret("10.1.2.3") and needs_secret("example.org")
    NodeConfig(node="n", kv_events_port=5557).validate()  # loopback: open events are allowed
    with pytest.raises(ConfigError, match="needs --events-secret-file"):
        NodeConfig(node="n", host="0.0.0.0", kv_events_port=5557).validate()
    NodeConfig(node="n", host="0.0.0.0", kv_events_port=5557, events_secret_file=_secret_file(tmp_path)).validate()
    with pytest.raises(ConfigError, match="needs --kv-events-port"):
        NodeConfig(node="n", events_secret_file=_secret_file(tmp_path)).validate()
    with pytest.raises(ConfigError, match="readable by other users"):
        NodeConfig(node="n", kv_events_port=5557, events_secret_file=_secret_file(tmp_path, mode=0o640)).validate()


def _subscriber(ctx: zmq.Context, port: int, secret: EventSecret | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, TOPIC)
    if secret is not None:
        secret.subscribe(s)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _serving(pub: KVEventPublisher, work) -> None:
    """Run `work` (a subscriber's blocking call) while this thread serves the replay socket, as
    the engine loop does between steps."""
    t = threading.Thread(target=work)
    t.start()
    while t.is_alive():
        pub.serve_replay()
        t.join(0.005)


def test_only_holders_read_the_events_and_the_published_keys_are_blind():
    secret, other = EventSecret.of(os.urandom(32)), EventSecret.of(os.urandom(32))
    decode, BlockStored, _, AllBlocksCleared = vllm_structs()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, 48).astype(np.int32) for _ in range(20)]
    keys = [BlockHasher(16, ROOT).update(p) for p in prompts]  # 3 blocks each
    port = free_port_pair()
    ctx = zmq.Context()
    snapshot = [CachedBlock(keys[0][0], None, GPU), CachedBlock(keys[0][1], keys[0][0], GPU)]
    pub = KVEventPublisher("127.0.0.1", port, 16, lambda: snapshot, secret=secret)
    holder = _subscriber(ctx, port, secret)
    outsiders = [_subscriber(ctx, port, None), _subscriber(ctx, port, other)]
    try:
        for _ in range(200):  # a PUB drops what it sends before a SUB's connection is up
            pub.cleared()
            pub.flush()
            if holder.poll(20):
                holder.recv_multipart()
                break
        else:
            raise AssertionError("the holder of the secret never got a batch")
        for k in keys:
            pub.stored(GPU, k, None)
        pub.flush()
        assert holder.poll(2000)
        _, seq, payload = holder.recv_multipart()
        batch = decode(payload)  # vLLM's struct shapes still read it
        published = [secret.publish(k) for k in keys[0]]
        assert batch.events[0] == BlockStored(published, None, [], 16, None, "GPU")
        seen = {h for ev in batch.events for h in ev.block_hashes}
        assert len(seen) == 60 and all(len(h) == 16 for h in seen)
        # the oracle: hash the right prompts under the published root, look them up: nothing
        guesses = {k for p in prompts for k in BlockHasher(16, ROOT).update(p)}
        assert len(guesses & seen) == 0
        assert {secret.publish(k) for k in guesses} == seen  # the holder maps them: every one
        assert not any(s.poll(WAIT_MS) for s in outsiders), "a subscriber without the secret got a batch"

        view = KVEventView(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", ctx, secret)
        _serving(pub, view.sync)
        assert view.last_seq == pub.seq and all(view.prefix(k) == 3 for k in keys)
        assert view.prefix(BlockHasher(16, ROOT).update(rng.integers(0, 512, 48).astype(np.int32))) == 0
        snap = pub.snapshot_payload()
        assert decode(snap).events == [AllBlocksCleared(), BlockStored([published[0]], None, [], 16, None, "GPU"),
                                       BlockStored([published[1]], published[0], [], 16, None, "GPU")]
        for sec in (None, other):  # the replay socket answers holders only
            ask = ctx.socket(zmq.DEALER)
            ask.setsockopt(zmq.LINGER, 0)
            if sec is not None:
                sec.subscribe(ask)
            ask.connect(f"tcp://127.0.0.1:{port + 1}")
            ask.send_multipart([b"", seq_bytes(1)])
            for _ in range(WAIT_MS // 10):
                pub.serve_replay()
                assert not ask.poll(10), "the replay socket answered a subscriber without the secret"
            ask.close(0)
        ask = ctx.socket(zmq.DEALER)
        ask.setsockopt(zmq.LINGER, 0)
        secret.subscribe(ask)
        ask.connect(f"tcp://127.0.0.1:{port + 1}")
        ask.send_multipart([b"", seq_bytes(pub.seq)])
        got = []
        for _ in range(300):
            pub.serve_replay()
            if ask.poll(10):
                got.append(ask.recv_multipart())
                if got[-1][1] == END_OF_REPLAY:
                    break
        assert [int.from_bytes(f[1], "big", signed=True) for f in got] == [pub.seq, -1]
        ask.close(0)
        view.close()
    finally:
        for s in (holder, *outsiders):
            s.close(0)
        pub.close()
        ctx.term()
