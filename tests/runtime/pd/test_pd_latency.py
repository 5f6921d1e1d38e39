"""What a decode node's first token after the handoff waits for, besides its one decode step:
the decode step itself (its worker's page faults), and the engine loop turns between hops."""
from __future__ import annotations

import subprocess
import sys
import time
from collections import deque

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.runtime.client import api
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.node.supervisor import CHILD_MALLOC, _child_env
from tests.nodekit import engine_with_worker

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


@pytest.mark.e2e
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


class _Server:
    """The engine's client socket reduced to its queues (what the I/O thread fills and sends)."""

    def __init__(self) -> None:
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self.notices: deque = deque()
        self.sent: list[tuple[bytes, object]] = []

    def send(self, client: bytes, data: bytes, keep: bool = False) -> None:
        self.sent.append((client, api.API.decode(data)))

    def probe(self, client: bytes) -> None:
        pass


@pytest.fixture
def engine(node):
    """A real engine over a real worker process (no client socket: the test plays it)."""
    cfg = NodeConfig(node, tp=1, block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, rank_timeout=20,
                     num_layers=2, num_kv_heads=2, head_dim=8).validate()
    with engine_with_worker(cfg) as eng:
        eng.server = _Server()
        yield eng


@pytest.mark.e2e
def test_the_next_step_leaves_in_the_turn_that_applied_the_last(engine):
    """A decode step is launched in the loop turn that applied the previous step's answer, not
    after the housekeeping and the next turn's start (a decode node's first step after kv-ready
    and every later one)."""
    engine.api.on_generate(b"client", api.GenerateRequest("r", np.arange(1, 11, dtype=np.int32), 6))
    deadline = time.monotonic() + 60
    generated = engine.stats.array[P.STAT["generated_tokens"]:][:1]
    applied = 0
    while not engine.sched.idle:
        assert time.monotonic() < deadline, "the request did not end"
        tokens = int(generated[0])
        engine.step()
        if generated[0] > tokens and not engine.sched.idle:  # this turn applied a step's answer
            applied += 1
            assert engine.sched.inflight is not None, "an answer was applied but the next step waits for a turn"
    assert applied == 5


@pytest.mark.e2e
def test_a_message_that_cuts_the_wait_short_is_handled_in_that_turn(engine, monkeypatch):
    """A message the I/O thread queues while the engine waits (a peer's kv-ready, a decode node's
    token to relay) is taken in before the turn ends, not after the housekeeping and a new turn."""
    wait = engine.answers.wait

    def arrives_during_the_wait(timeout):
        got = wait(timeout)
        engine.server.inbox.append((b"client", api.API.encode(api.InfoRequest(7))))
        return got

    monkeypatch.setattr(engine.answers, "wait", arrives_during_the_wait)
    engine.step()
    assert [type(m) for _, m in engine.server.sent] == [api.InfoReply]
