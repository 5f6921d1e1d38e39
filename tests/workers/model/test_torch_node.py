"""A node serving a checkpoint with `--model-backend torch`: the float64 reference's greedy tokens
through the prefix cache, evictions, swaps and preemption, at --tp 1 and --tp 2 (the all-reduce
between torch tensors through the node's shared memory), in float32 and bfloat16. On a CPU the
plain-torch op set runs; skipped without torch (the default CPU suite). The GPU's runs, with
Triton kernels and CUDA graphs, are tests/workers/model/test_gpu_torch.py's."""
from __future__ import annotations

import pytest

from tests.launched import launched
from tests.runtime.engine.test_oracle import run_all, tokens
from tests.torchkit import torch_device
from tests.workers.model.test_hf_oracle import OPTS, checkpoint, expected, prompts  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e
torch_device()


@pytest.mark.parametrize("tp, compute", [(1, "float32"), (2, "bfloat16")])
def test_a_torch_node_serves_the_reference(node, tmp_path, checkpoint, prompts, expected, tp, compute):
    opts = (*OPTS, "--model", checkpoint.path, "--model-backend", "torch", "--tp", str(tp), "--compute-dtype",
            compute, "--num-gpu-blocks", "40", "--num-cpu-blocks", "64", "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}) as ln:
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0
        assert stats["evictions"] > 0
        assert "torch backend on cpu" in ln.logs()
