"""Liveness by progress on a real node: a worker in a step far longer than --hang-timeout (three
4,096-token prompts in one step, seconds in its one layer on a CPU) is not taken for a hung
one, and the engine's deadline for that step grows with its size beyond --rank-timeout. (A
stopped worker is still found hung within the timeout: tests/runtime/node/test_supervision.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.ipc.config import NodeConfig
from kvrt.runtime.client.api import ErrorEvent
from kvrt.runtime.client.client import Result
from kvrt.workers.model.transformer import Model, ModelShape
from tests.launched import launched

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

PROMPT, NEW = 4096, 3
# one layer, wide enough that the layer takes seconds over 3 x 4,096 tokens on one core
SHAPE = dict(num_layers=1, num_kv_heads=4, head_dim=64, block_size=16, max_model_len=PROMPT + 8)


def test_three_long_prompts_in_one_step_finish_with_a_hang_timeout_of_one_second(node, tmp_path):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, PROMPT).astype(np.int32) for _ in range(3)]
    opts = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    with launched(node, tmp_path, *opts, "--num-gpu-blocks", str(3 * (PROMPT // 16 + 1) + 8),
                  "--max-num-batched-tokens", str(3 * PROMPT), "--hang-timeout", "1", "--rank-timeout", "2") as ln:
        rids = [ln.client.submit(p, NEW) for p in prompts]
        done: dict[str, list[int]] = {}
        while len(done) < len(rids):
            events = ln.client.poll(120)
            assert events, f"no answer within 120 s:\n{ln.logs()}"
            assert not [ev for ev in events if isinstance(ev, ErrorEvent)], (events, ln.logs())
            done.update((ev.request_id, [int(t) for t in ev.output_token_ids]) for ev in events
                        if isinstance(ev, Result))
        assert ln.proc.poll() is None, ln.logs()
    model = Model(ModelShape.from_config(NodeConfig(node="", **SHAPE)))
    assert [done[r] for r in rids] == [model.generate_dense(p, NEW) for p in prompts]
