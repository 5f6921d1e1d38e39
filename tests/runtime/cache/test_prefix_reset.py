"""The prefix-cache reset on a real node (`Client.reset_prefix_cache`): with a host tier, a file
storage tier and a request in flight, it frees every cached block nothing holds, the request in
flight still finishes with the dense reference's answer, a prompt cached before is computed
again from scratch, every block is free once the request ends, and a KV events subscriber's
view of the node is emptied by the reset. `POST /reset_prefix_cache` on the node's HTTP port
does the same."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import zmq
import pytest

from kvrt.ipc.ports import free_port, free_port_pair
from kvrt.runtime.cache.events import KVEventView
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.client.client import Result
from kvrt.runtime.node.config import NodeConfig
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import _wait_healthy

pytestmark = pytest.mark.e2e

BS = 8  # SMALL's block size
NEW = 4
LONG = 300  # new tokens of the request in flight: it decodes all through the reset


def test_reset_with_a_request_in_flight(node, tmp_path):
    rng = np.random.default_rng(11)
    warm = [rng.integers(0, 512, 12 * BS + 3).astype(np.int32) for _ in range(6)]  # 72 blocks: 64 fit
    busy = rng.integers(0, 512, 5 * BS).astype(np.int32)
    events, http = free_port_pair(), free_port()
    opts = (*SMALL, "--num-gpu-blocks", "64", "--num-cpu-blocks", "64", "--storage", f"file:{tmp_path / 'store'}",
            "--kv-events-port", str(events), "--http-port", str(http))
    root = NodeConfig(node="", num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS).key_root
    ctx = zmq.Context()
    view = KVEventView(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}", ctx)
    try:
        with launched(node, tmp_path / "logs", *opts) as ln:
            c = ln.client
            for p in warm:
                c.generate(p, NEW)
            ln.idle_stats()  # write-through done
            view.sync()
            assert view.prefix(BlockHasher(BS, root).update(warm[-1])) == 12, "the view holds the warm blocks"
            assert c.generate(warm[-1], NEW).cached_tokens == 12 * BS
            rid = c.submit(busy, LONG)
            first = c.poll(30.0)
            assert first and first[0].request_id == rid, f"the request in flight did not start: {first}"
            got = c.reset_prefix_cache()
            assert got.device > 0 and got.host > 0, f"the warm blocks were on both tiers: {got}"
            assert got.held_device >= 5, f"the request in flight held its prompt's blocks: {got}"
            assert got.storage == 6 * 12, f"the file tier's index held every warm block: {got}"
            view.sync()
            assert view.media == {}, "a subscriber's view after the reset is the empty cache"
            done = None
            while done is None:
                evs = c.poll(30.0)
                assert evs, "the request in flight never finished"
                done = next((e for e in evs if isinstance(e, Result)), None)
            assert done.output_token_ids.tolist() == oracle().generate_dense(busy, LONG)
            stats = ln.idle_stats()
            assert (stats["device_used"], stats["host_used"], stats["device_cached"], stats["host_cached"]) == \
                (0, 0, 0, 0), "every block is free once the request in flight ended"
            again = c.generate(warm[-1], NEW)
            assert (again.cached_device, again.cached_host, again.cached_storage) == (0, 0, 0)
            assert again.computed_prompt_tokens == len(warm[-1])
            assert again.output_token_ids.tolist() == oracle().generate_dense(warm[-1], NEW)
            ln.idle_stats()  # its blocks written through
            _wait_healthy(http)
            post = urllib.request.Request(f"http://127.0.0.1:{http}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(post, timeout=30) as r:
                assert json.load(r) == {"freed": {"device": 12, "host": 0}, "held": {"device": 0, "host": 0},
                                        "storage_keys_forgotten": 12}
            assert c.generate(warm[-1], NEW).cached_tokens == 0
    finally:
        view.close()
        ctx.term()
