"""Shared fixtures: a unique node name per test, and a check that nothing of it is left in /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

# single-threaded BLAS in the test process and every process it starts, as `kvrt launch` does
# for its children (a BLAS thread pool on a loaded 2-core machine makes small matmuls ~100x slower)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def leftovers(node: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith((f"kvrt.{node}.", f"sem.kvrt.{node}."))]


@pytest.fixture
def node():
    """A fresh node name; the test fails if any object of that node outlives it."""
    name = "t" + uuid.uuid4().hex[:10]
    yield name
    left = leftovers(name)
    assert not left, f"shared-memory objects leaked: {left}"


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter (a real separate process, no fork, no pickle)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def spawn_py(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
