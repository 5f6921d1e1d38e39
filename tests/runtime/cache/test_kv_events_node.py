"""KV events of a real node (`kvrt launch --kv-events-port P`), read by real ZeroMQ subscribers:
the keys of a prompt's blocks arrive as BlockStored events and are the keys runtime/cache/keys.py
gives for that prompt under the node's key root; evicted blocks arrive as BlockRemoved; a
subscriber that starts late sees the gap and catches up through the replay socket."""
from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import zmq
import pytest

from kvrt.ipc.ports import free_port, free_port_pair
from kvrt.runtime.cache.events import TOPIC, KVEventView, decode_batch
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.node.config import NodeConfig
from tests.launched import SMALL, launched
from tests.runtime.http.test_http import _wait_healthy

pytestmark = pytest.mark.e2e


def _until(view: KVEventView, seq: int, timeout: float = 10.0) -> None:
    """Apply events until the view has applied batch `seq`."""
    deadline = time.monotonic() + timeout
    while view.last_seq < seq:
        view.poll(50)
        assert time.monotonic() < deadline, f"view at batch {view.last_seq}, waiting for {seq}"


def _until_connected(ln, subs, rng, tries: int = 50) -> None:
    """Send small requests until every subscriber (a raw SUB socket or a view) got a batch: a SUB
    that is not connected yet misses what is published."""
    pending = list(subs)
    for _ in range(tries):
        ln.client.generate(rng.integers(0, 512, 9).astype(np.int32), 1)
        for s in list(pending):
            if (s.poll(200) if isinstance(s, KVEventView) else s.poll(200) and s.recv_multipart()):
                pending.remove(s)
        if not pending:
            return
    raise AssertionError(f"{len(pending)} subscriber(s) got no batch after {tries} requests")


def test_node_publishes_the_prompts_keys_evictions_and_replays_a_late_subscriber(node, tmp_path):
    events, http = free_port_pair(), free_port()
    ctx = zmq.Context()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "16", "--kv-events-port", str(events),
                  "--http-port", str(http)) as ln:
        _wait_healthy(http)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/kvrt/cache", timeout=10) as r:
            info = json.load(r)
        root = NodeConfig(node="", num_layers=2, num_kv_heads=2, head_dim=16, block_size=8).key_root
        assert info["key_root"] == root.hex() and info["block_size"] == 8
        assert info["kv_events"] == f"tcp://127.0.0.1:{events}"
        early = KVEventView(info["kv_events"], info["kv_events_replay"], ctx)
        raw = ctx.socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SUBSCRIBE, TOPIC)
        raw.connect(info["kv_events"])
        rng = np.random.default_rng(0)
        _until_connected(ln, (raw, early), rng)
        gaps = early.gaps  # (one if the view connected after the first warm-up batch)
        prompts = [rng.integers(0, 512, 40).astype(np.int32) for _ in range(4)]
        keys = [BlockHasher(8, root).update(p) for p in prompts]
        ln.client.generate(prompts[0], 4)
        seqs = []
        while raw.poll(2000):
            topic, seq, payload = raw.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            early.poll(0)
            if set(keys[0]) <= set(early.media):
                break
        assert set(keys[0]) <= set(early.media), "the prompt's block keys were not published"
        assert all(early.media[k] == {"GPU"} for k in keys[0])
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered without gaps
        for p in prompts[1:]:  # 4 x 6 blocks through a 16-block device: the first prompt's go
            ln.client.generate(p, 4)
        late = KVEventView(info["kv_events"], info["kv_events_replay"], ctx)  # has missed every batch so far
        _until_connected(ln, (late,), rng)
        assert late.gaps == 1 and late.lost == 0  # its first batch showed the gap; the replay filled it
        ln.client.generate(prompts[0][:17], 1)
        ln.idle_stats()
        last = 0
        while raw.poll(300):  # every batch published so far
            last = int.from_bytes(raw.recv_multipart()[1], "big")
        _until(early, last)
        _until(late, last)
        assert early.gaps == gaps and early.lost == 0
        assert not set(keys[0][2:]) & set(early.media), "evicted blocks were not removed"
        assert early.media == late.media
        ask = ctx.socket(zmq.DEALER)  # the replay socket as vLLM's subscriber asks it: from batch 1
        ask.setsockopt(zmq.LINGER, 0)
        ask.connect(info["kv_events_replay"])
        ask.send_multipart([b"", (1).to_bytes(8, "big")])
        assert ask.poll(5000), "no answer from the replay socket"
        _, seq, payload = ask.recv_multipart()
        assert int.from_bytes(seq, "big") == 1 and decode_batch(1, payload).events == [["AllBlocksCleared"]]
        ask.close(0)
        stats = ln.idle_stats()
        assert len(early.media) == stats["device_cached"]
        early.close()
        late.close()
        raw.close(0)
    ctx.term()


REPLAY_FLOODER = """
import sys
from tests.flooder import flood
# from batch 1: a snapshot each
print(flood(sys.argv[1], [[b"", (1).to_bytes(8, "big")]], float(sys.argv[2]), sndhwm=100000))
"""


@pytest.mark.alone
def test_a_flood_of_replay_requests_leaves_another_client_served_right(node, tmp_path):
    """Two sockets asking the replay port for everything from batch 1 as fast as they can (each
    answer a snapshot of the whole cache) while another client sends its requests: the node
    keeps serving it the right tokens, and stays up. (Its latency with and without the flood is
    logged: such a flood once took another client's time to first token from 14 ms to seconds.)"""
    import logging
    import statistics
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.launched import oracle

    log = logging.getLogger(__name__)
    events = free_port_pair()
    rng = np.random.default_rng(21)
    warm = [rng.integers(0, 512, 120).astype(np.int32) for _ in range(12)]  # a cache worth snapshotting
    prompts = [rng.integers(0, 512, int(rng.integers(5, 40))).astype(np.int32) for _ in range(24)]
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "256", "--kv-events-port", str(events),
                  "--hang-timeout", "2") as ln:
        for p in warm:
            ln.client.generate(p, 1)
        quiet = [ln.client.generate(p, 4, timeout=30) for p in prompts[:6]]
        flood = subprocess.Popen([sys.executable, "-c", REPLAY_FLOODER, f"tcp://127.0.0.1:{events + 1}", "3"],
                                 cwd=REPO, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the flood is on
        got = []
        for p in prompts:
            if flood.poll() is not None:
                break
            got.append((p, ln.client.generate(p, 4, timeout=30)))
        rate = float(flood.communicate(timeout=30)[0])
        assert ln.proc.poll() is None, ln.logs()
        assert ln.client.info(timeout=10).node == node
    assert len(got) >= 3, "the good client finished fewer than 3 requests during the flood"
    model = oracle()
    assert all(r.output_token_ids.tolist() == model.generate_dense(p, 4) for p, r in got)
    log.info("replay flood of %.0f requests/s: e2e median %.1f ms with it, %.1f ms before it", rate,
             statistics.median(r.e2e_ms for _, r in got), statistics.median(r.e2e_ms for r in quiet))
