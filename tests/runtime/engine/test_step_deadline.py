"""The bounds of a step in flight (runtime/engine/step_runner.py): a step is overdue only when
its workers made no progress for the progress bound (the rank timeout, or more once steps showed
longer stretches without progress) and it ran past its size bound (the rank timeout, more for a
bigger step); on a GPU node its first steps may also compile (a worker compiles a kernel at its
first use of a shape). tests/runtime/engine/test_step_progress.py runs the case on a node."""
from __future__ import annotations

import pytest

from kvrt.runtime.engine.step_runner import COMPILE_ALLOWANCE_S, COMPILE_STEPS, FIRST_STEP_WORK, SLACK, StepRunner
from kvrt.runtime.node.config import NodeConfig


def runner(device: str) -> StepRunner:
    return StepRunner(NodeConfig("t", device=device, rank_timeout=10.0), [], None, None, None, None, 0.01)


def test_the_size_bound_is_the_rank_timeout_and_more_for_more_work():
    r = runner("cpu")
    assert r.deadline_for(1) == pytest.approx(10.0, abs=1e-3)
    assert r.deadline_for(int(FIRST_STEP_WORK)) == pytest.approx(20.0)


def test_the_progress_bound_is_the_rank_timeout_until_answered_steps_show_longer_stretches():
    r = runner("cpu")
    assert r.stall_s() == pytest.approx(10.0)
    r._longest_still = 1.0
    assert r.stall_s() == pytest.approx(10.0)
    r._longest_still = 5.0
    assert r.stall_s() == pytest.approx(SLACK * 5.0)


def test_a_gpu_nodes_first_steps_may_compile_and_later_ones_may_not():
    r = runner("cuda")
    assert r.stall_s() == pytest.approx(10.0 + COMPILE_ALLOWANCE_S)
    r._answered = COMPILE_STEPS
    assert r.stall_s() == pytest.approx(10.0)
