"""How many device blocks a GPU node gets, decided before anything is allocated: an explicit
--num-gpu-blocks is checked against each GPU's free memory (a clear refusal naming both, not a
raw cudaErrorMemoryAllocation), and without it the count is --gpu-memory-utilization of the free
memory. The computation is pure and tested here on any machine; the CUDA part skips cleanly."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvrt.runtime.node.config import ConfigError, NodeConfig
from tests.conftest import REPO
from kvrt.workers.backend import DeviceMemoryError
from kvrt.workers.kv_pool import fmt_bytes, plan_gpu_blocks, ranks_per_device
from tests.gpukit import cuda_cupy

GIB = 1 << 30
BB = 2 << 20  # a 2 MiB block


def test_default_takes_the_utilization_share_of_the_free_memory():
    assert plan_gpu_blocks(None, 0.9, BB, 1, [10 * GIB]) == int(10 * GIB * 0.9) // BB
    assert plan_gpu_blocks(None, 0.5, BB, 1, [10 * GIB]) == 10 * GIB // 2 // BB
    # two ranks on one GPU share it; on two GPUs the fuller one decides, so every rank is equal
    assert plan_gpu_blocks(None, 1.0, BB, 2, [8 * GIB]) == 8 * GIB // 2 // BB
    assert plan_gpu_blocks(None, 1.0, BB, 2, [8 * GIB, 2 * GIB]) == 2 * GIB // BB
    assert ranks_per_device(3, 2) == [2, 1] and ranks_per_device(1, 4) == [1, 0, 0, 0]
    assert plan_gpu_blocks(None, 1.0, BB, 1, [8 * GIB, 0]) == 8 * GIB // BB  # an unused GPU does not count


def test_asking_for_more_than_a_gpu_holds_names_free_and_asked():
    assert plan_gpu_blocks(1024, 0.9, BB, 1, [2 * GIB + 1]) == 1024  # fits: utilization caps only the default
    with pytest.raises(DeviceMemoryError) as e:
        plan_gpu_blocks(4096, 0.9, BB, 2, [10 * GIB])
    msg = str(e.value)
    assert "--num-gpu-blocks 4096" in msg and fmt_bytes(4096 * BB * 2) in msg and fmt_bytes(10 * GIB) in msg
    assert "at most 2560 blocks" in msg  # 10 GiB / (2 ranks x 2 MiB)
    with pytest.raises(DeviceMemoryError, match="does not hold one"):
        plan_gpu_blocks(None, 0.9, BB, 1, [BB])
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        plan_gpu_blocks(None, 0.0, BB, 1, [GIB])


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, float("nan")])
def test_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        NodeConfig(node="n", gpu_memory_utilization=value).validate()


@pytest.mark.e2e
def test_cpu_default_is_unchanged():
    """No CUDA needed, and no CuPy imported, for a CPU node's default pool."""
    code = ("import sys; from kvrt import launcher; from kvrt.runtime.node.config import NodeConfig;"
            "p = launcher.argparse.ArgumentParser(); s = p.add_subparsers(); launcher._add_launch(s);"
            "a = p.parse_args(['launch', '--device', 'cpu']);"
            "assert a.num_gpu_blocks is None and a.gpu_memory_utilization == 0.9;"
            "assert NodeConfig(node='n').num_gpu_blocks == 512; assert 'cupy' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_cuda_free_memory_on_a_gpu():
    cupy = cuda_cupy()
    from kvrt.workers.kv_pool import cuda_free_bytes

    free = cuda_free_bytes()
    assert len(free) == cupy.cuda.runtime.getDeviceCount() and all(f > 0 for f in free)
    with pytest.raises(DeviceMemoryError, match="free"):
        plan_gpu_blocks(max(free) // BB + 1, 0.9, BB, 1, free[:1])


@pytest.mark.e2e
def test_launch_on_a_gpu_refuses_more_blocks_than_it_holds(node):
    cuda_cupy()
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, "--device", "cuda",
                        "--num-gpu-blocks", str(1 << 40)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--num-gpu-blocks" in r.stderr and "free" in r.stderr, r.stderr
    assert "cudaErrorMemoryAllocation" not in r.stderr
