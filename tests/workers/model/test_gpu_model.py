"""The GPU half of real models, on a machine with CUDA and CuPy (skipped elsewhere; the command
that runs it on a lent GPU machine is in docs/development.md, "GPU validation"):
- the checkpoint oracle of tests/workers/model/test_hf_dtype.py on CuPy: float16 compute (cuBLAS, float32
  accumulation) within the float16 tolerance of the dense float64 reference with its greedy
  tokens, float32 compute exact to 1e-4, for every architecture (sliding windows, soft caps,
  experts included);
- the all-reduce over CUDA IPC buffers (workers/cuda_allreduce.py) between real processes on
  one GPU: exact sums, bit-identical on every rank, both buffers reused many times;
- a node with `--device cuda --model-backend array`, `--tp 1` and `--tp 2` on one GPU, float16,
  bfloat16 (computed as float16) and float32 compute: the reference's greedy tokens, through the
  prefix cache and swaps to the host tier (the torch backend's: test_gpu_torch.py).
"""
from __future__ import annotations

import pytest

from tests.conftest import spawn_py
from tests.hfkit import ARCH_CASES, case_config, make_checkpoint
from tests.launched import launched
from tests.workers.model.test_hf_dtype import ARCHS, F16_TOL, check_dtype, check_greedy
from tests.workers.model.test_hf_oracle import OPTS, checkpoint, expected, prompts  # noqa: F401 (fixtures)
from tests.runtime.engine.test_oracle import run_all, tokens
from tests.gpukit import cuda_cupy

cupy = cuda_cupy()


@pytest.mark.parametrize("file_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float16_on_cuda_matches_dense_float64(tmp_path, arch, file_dtype):
    ck = make_checkpoint(tmp_path, arch, dtype=file_dtype, tied=arch == "Qwen3ForCausalLM")
    check_dtype(ck, "float16", "float16", F16_TOL, xp=cupy)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_on_cuda_stays_exact(tmp_path, arch):
    check_dtype(make_checkpoint(tmp_path, arch, dtype="BF16"), "float32", "float32", 1e-4, xp=cupy)


@pytest.mark.parametrize("arch", ARCHS)
def test_float16_on_cuda_greedy_tokens_equal_the_reference(tmp_path, arch):
    check_greedy(make_checkpoint(tmp_path, arch, dtype="BF16", seed=3), xp=cupy)


@pytest.mark.parametrize("compute, tol", [("float16", F16_TOL), ("float32", 1e-4)])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_each_architecture_on_cuda_matches_dense_float64(tmp_path, case, compute, tol):
    arch, cfg = case_config(case)
    check_dtype(make_checkpoint(tmp_path, arch, dtype="BF16", config=cfg), compute, compute, tol, xp=cupy)


RANK = """
import sys
import cupy, numpy as np
from kvrt.ipc.allreduce import AllReduce
from kvrt.ipc.registry import Registry
from kvrt.workers.cuda_allreduce import CudaPeerMemory
reg = Registry.attach(sys.argv[1])
rank, tp, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cupy.cuda.runtime.setDevice(0)  # every rank on one GPU: the single-GPU machine's --tp 2
ar = AllReduce.attach(reg, "ar", rank, timeout=60, memory=CudaPeerMemory())
digest = 0.0
for g in range(rounds):
    n = 1 + (g * 37) % 500
    x = cupy.asarray(np.random.default_rng([g, rank]).standard_normal(n).astype(np.float32))
    s = ar.sum(x)
    assert isinstance(s, cupy.ndarray) and s.shape == (n,)
    want = sum(np.random.default_rng([g, r]).standard_normal(n).astype(np.float32) for r in range(tp))
    assert np.allclose(cupy.asnumpy(s), want, rtol=1e-5, atol=1e-5), g
    digest += float(cupy.asnumpy(s).astype(np.float64) @ np.arange(n))
ar.close()
print(repr(digest))
"""


@pytest.mark.e2e
def test_cuda_ipc_allreduce_between_processes_on_one_gpu(node):
    from kvrt.ipc.allreduce import AllReduce
    from kvrt.ipc.registry import Registry

    tp, rounds = 2, 300
    with Registry.create(node) as reg:
        AllReduce.create(reg, "ar", tp, 512, peer_memory=True)
        procs = [spawn_py(RANK, node, str(r), str(tp), str(rounds)) for r in range(tp)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
            outs.append(out.strip())
        assert len(set(outs)) == 1, f"ranks disagree: {outs}"


@pytest.mark.e2e
@pytest.mark.parametrize("tp, compute", [(1, "float16"), (2, "bfloat16"), (2, "float32")])
def test_a_cuda_node_serves_the_reference(node, tmp_path, checkpoint, prompts, expected, tp, compute):
    """The array path (CuPy); the torch backend's nodes are test_gpu_torch.py's."""
    opts = (*OPTS, "--device", "cuda", "--model", checkpoint.path, "--model-backend", "array", "--tp", str(tp),
            "--compute-dtype", compute, "--num-gpu-blocks", "48", "--num-cpu-blocks", "64",
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}, ready_s=180) as ln:
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0


@pytest.mark.e2e
def test_a_fresh_kernel_cache_does_not_make_the_first_step_look_hung(node, tmp_path, checkpoint, prompts, expected):
    """CuPy compiles each kernel at its first call; with an empty kernel cache (a fresh machine)
    a first forward pass compiles for seconds. The worker does that before it says ready, so
    the first request is not a heartbeat gap past the default --hang-timeout (5 s)."""
    opts = (*OPTS, "--device", "cuda", "--model", checkpoint.path, "--model-backend", "array",
            "--compute-dtype", "float16", "--num-gpu-blocks", "48")
    with launched(node, tmp_path, *opts, env={"CUPY_CACHE_DIR": str(tmp_path / "kernels")}, ready_s=180) as ln:
        assert tokens(run_all(ln.client, prompts[:2], concurrent=False)) == expected[:2], ln.logs()
