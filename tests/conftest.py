"""Shared fixtures: a unique node name per test, and a check that nothing of it is left in /dev/shm;
and the guard that keeps the fast lane free of processes."""
from __future__ import annotations

import multiprocessing.util
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


class ProcessInFastLane(AssertionError):
    """A test not marked e2e started a process."""


def _refuse_processes(item: pytest.Item):
    """While a test not marked e2e runs (its fixtures included), starting a process fails it: the
    fast lane (`-m "not e2e"`) stays fast because nothing in it starts one."""
    def refuse(*args, **kwargs):
        raise ProcessInFastLane(f"{item.nodeid} starts a process: mark it e2e (pytest.mark.e2e)")

    saved = [(subprocess.Popen, "_execute_child", subprocess.Popen._execute_child), (os, "fork", os.fork),
             (os, "posix_spawn", os.posix_spawn), (os, "posix_spawnp", os.posix_spawnp),
             (multiprocessing.util, "spawnv_passfds", multiprocessing.util.spawnv_passfds)]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    return saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.get_closest_marker("e2e") is not None:
        yield
        return
    saved = _refuse_processes(item)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
