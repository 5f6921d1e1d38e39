"""Shared fixtures: a unique node name per test, and a check that nothing of it is left in /dev/shm;
the guard that keeps the fast lane free of processes; and the turns of e2e tests on two
pytest-xdist workers."""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing.util
import os
import subprocess
import sys
import uuid

# single-threaded BLAS in the test process and every process it starts, as `kvrt launch` does
# for its children (a BLAS thread pool on a loaded 2-core machine makes small matmuls ~100x slower)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Triton reads this when a kernel is defined: without an NVIDIA device its interpreter runs the
# torch backend's kernels on the CPU (tests/torchkit.py), the kernels lane's way of testing them
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis' defaults for every property test (a test's own settings start from these):
# - no deadline: the default 200 ms per example is a timing assertion, and on a loaded 2-core
#   machine (two xdist workers, other work beside them) a cheap example can pass it and fail it
#   on the rerun, which hypothesis reports as a flaky failure;
# - the failing example's blob printed: CI starts from an empty example database (`.hypothesis/`
#   in the checkout, which replays a machine's own past failures first), so the log is where
#   a failure found there is reproduced from (`@reproduce_failure`).
settings.register_profile("kvrt", deadline=None, print_blob=True)
settings.load_profile("kvrt")

# matplotlib builds its font cache on first use by running `fc-list`: a process, which the fast
# lane's guard refuses inside a test. Built here, before any test, a cold machine (no cache yet)
# pays it once per worker and the plotting tests stay in the fast lane.
with contextlib.suppress(ImportError):
    import matplotlib  # noqa: E402

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: E402,F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile kvrt's modules to bytecode once, before any test starts a process. Why: an
    editable install leaves kvrt's sources uncompiled, and where PYTHONDONTWRITEBYTECODE is set
    no process ever writes their bytecode, so each of a node's interpreters compiled every
    module it imports from source, at every start (about a fifth of a small node's CPU from start
    to stop). Compiling explicitly writes the bytecode whatever that variable says; the
    interpreters then only read it. Once, on the controller (xdist workers share its result)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    import compileall

    for package in ("ipc", "runtime", "workers", "bench"):
        compileall.compile_dir(os.path.join(REPO, package), quiet=1)
    for top in ("__init__.py", "launcher.py"):
        compileall.compile_file(os.path.join(REPO, top), quiet=1)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Let pytest keep its assertion-rewritten test modules while it collects them. Why: it
    rewrites every test module's asserts at import and caches the result beside the module,
    but not where PYTHONDONTWRITEBYTECODE is set (as on this workplace's machines): every
    pytest process, each xdist worker included, then rewrote and compiled all of them again, the
    larger part of collecting the fast lane. The variable applies again once collection is done."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


def leftovers(node: str) -> list[str]:
    """What of `node` is left: shared-memory objects, and its private socket directory."""
    from kvrt.ipc.sockets import socket_dir

    shm = [n for n in os.listdir("/dev/shm") if n.startswith((f"kvrt.{node}.", f"sem.kvrt.{node}."))]
    return shm + [d for d in [socket_dir(node)] if os.path.lexists(d)]


def reclaim_dead(node: str) -> None:
    """What `kvrt clean --node NODE` does, in this process rather than a new interpreter's: a
    dead (killed) node's objects are unlinked; a live one's are left, for `leftovers` to report."""
    from kvrt.ipc.errors import NodeLive
    from kvrt.ipc.registry import reclaim

    with contextlib.suppress(NodeLive):
        reclaim(node)


@pytest.fixture
def node():
    """A fresh node name; the test fails if any object of that node outlives it (its shared
    memory, its private socket directory)."""
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


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("e2e") is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `alone` e2e tests last, each group in its collected order. Why: an `alone` test
    waits for the other worker's current test to end before it starts, so among the others each
    one cost that wait on top of its own time; run one after another at the end of the lane, an
    `alone` test follows another `alone` one and waits for nothing. (xdist's workers hand out the
    collected order, which every worker computes alike.)"""
    items.sort(key=_alone)  # a stable sort: False (shared) before True (alone)


@contextlib.contextmanager
def _turn(item: pytest.Item):
    """On pytest-xdist workers (`-n 3`), e2e tests run side by side, except one marked `alone`,
    which runs with no other test beside it: it waits on short timeouts of real processes, bounds
    a time, or keeps every core busy, and a second test on a 2-core machine would be a flake.
    A readers-writer lock shared by the workers, on two bytes of one file in the run's temporary
    directory: byte 1 is held shared by a test and exclusively by an `alone` one; byte 0, the
    turnstile, is held while waiting for byte 1, so a waiting `alone` test is not overtaken."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # the run's directory, above each worker's own (pytest removes it with old runs)
    path = item.config._tmp_path_factory.getbasetemp().parent / "e2e-turns.lock"
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") is not None else fcntl.LOCK_SH
    with open(path, "a+b") as f:
        fcntl.lockf(f, fcntl.LOCK_EX, 1, 0)
        try:
            fcntl.lockf(f, mode, 1, 1)
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN, 1, 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.get_closest_marker("e2e") is not None:
        with _turn(item):
            yield
        return
    saved = _refuse_processes(item)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
