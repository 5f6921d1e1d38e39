"""BLAS threads per step: what `auto` picks for a step's rows, that a step's count is in force
inside it and gone after it, and the refusals. No timing: `kvrt bench model --threads` measures
whether the choice pays."""
from __future__ import annotations

import numpy as np  # noqa: F401  (loads the BLAS whose threads are set)
import pytest
from threadpoolctl import threadpool_info

from kvrt.workers.model.threads import AUTO, PARALLEL_ROWS, BlasThreads, runnable_others, usable_cores

HAS_BLAS = any(lib["user_api"] == "blas" for lib in threadpool_info())


def test_auto_uses_one_thread_for_decode_sized_steps_and_every_free_core_for_large_ones():
    t = BlasThreads(AUTO, cores=4, others=lambda: 0)
    assert [t.count(r) for r in (1, 32, PARALLEL_ROWS - 1, PARALLEL_ROWS, 512)] == [1, 1, 1, 4, 4]


@pytest.mark.parametrize("others, threads", [(0, 4), (1, 3), (3, 1), (50, 1)])
def test_auto_leaves_the_cores_other_processes_run_on(others, threads):
    assert BlasThreads(AUTO, cores=4, others=lambda: others).count(PARALLEL_ROWS) == threads


def test_runnable_others_reads_a_count():
    assert runnable_others() >= 0


def test_a_fixed_setting_is_used_for_every_step():
    t = BlasThreads(3, cores=2)
    assert {t.count(r) for r in (1, PARALLEL_ROWS, 4096)} == {3}


def test_negative_settings_are_refused():
    with pytest.raises(ValueError, match="threads"):
        BlasThreads(-1)


def test_usable_cores_shares_the_affinity_over_ranks():
    assert usable_cores() >= 1 and usable_cores(10_000) == 1
    assert usable_cores(2) == max(1, usable_cores() // 2)


@pytest.mark.skipif(not HAS_BLAS, reason="threadpoolctl sees no BLAS library here")
def test_a_steps_count_is_in_force_inside_it_and_restored_after():
    t = BlasThreads(AUTO, cores=3, others=lambda: 0)
    before = t.current()
    with t.for_rows(1):
        assert t.current() == 1
    with t.for_rows(PARALLEL_ROWS):
        assert t.current() == 3
    assert t.current() == before
    with BlasThreads(2).for_rows(1):
        assert t.current() == 2
    assert t.current() == before
