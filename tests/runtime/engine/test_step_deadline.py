"""The deadline of a step in flight (runtime/engine/step_runner.py): the rank timeout, more for
a bigger step, and on a GPU node a compile allowance for its first steps only (a worker
compiles a kernel at its first use of a shape)."""
from __future__ import annotations

import pytest

from kvrt.runtime.engine.step_runner import COMPILE_ALLOWANCE_S, COMPILE_STEPS, FIRST_STEP_WORK, StepRunner
from kvrt.runtime.node.config import NodeConfig


def runner(device: str) -> StepRunner:
    return StepRunner(NodeConfig("t", device=device, rank_timeout=10.0), [], None, None, None, None, 0.01)


def test_a_cpu_node_waits_the_rank_timeout_and_more_for_more_work():
    r = runner("cpu")
    assert r.deadline_for(1) == pytest.approx(10.0, abs=1e-3)
    assert r.deadline_for(int(FIRST_STEP_WORK)) == pytest.approx(20.0)


def test_a_gpu_nodes_first_steps_may_compile_and_later_ones_may_not():
    r = runner("cuda")
    assert r.deadline_for(1) == pytest.approx(10.0 + COMPILE_ALLOWANCE_S, abs=1e-3)
    r._answered = COMPILE_STEPS
    assert r.deadline_for(1) == pytest.approx(10.0, abs=1e-3)
