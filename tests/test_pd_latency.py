"""What a decode node's first token after the handoff waits for, besides its one decode step."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.node import CHILD_MALLOC, _child_env

# A decode step's allocation pattern: temporaries of about 1 MiB, alive together, freed at the
# end of the step; prints the page faults one such step takes once warmed up.
_STEPS = """
import resource, numpy as np
def step():
    tmp = [np.ones(96 * 1024 + k * 8192) for k in range(8)]
    del tmp
step(); step()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) // 20)
"""


def _faults_per_step(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_children_keep_their_heap_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's children run with malloc thresholds that keep step temporaries in the heap: a
    process that never ran a large prefill (a decode node's worker) takes no page faults per
    step, where glibc's defaults gave ~2,000 (about 3 ms of every decode step)."""
    for var in CHILD_MALLOC:
        monkeypatch.delenv(var, raising=False)
    env = _child_env()
    assert {k: env[k] for k in CHILD_MALLOC} == CHILD_MALLOC
    assert _faults_per_step(env) < 100


def test_a_users_malloc_setting_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    env = _child_env()
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0" and "MALLOC_MMAP_THRESHOLD_" not in env
