"""A deep model's first long step on a heavily loaded machine: its worker gets a quarter of a
core (the test stops and continues it in turn, as a busy scheduler would), so the step runs
several times longer than a first guess from its size allows, while it still makes a mark of
progress for every layer and tile of attention, each well inside the bound. The engine bounds a
step by its workers' progress (runtime/engine/step_runner.py): the request is answered and the
node goes on, where the guess alone stopped a healthy node."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import numpy as np
import pytest

from kvrt.runtime.node.status import snapshot
from tests.launched import launched

pytestmark = [pytest.mark.e2e, pytest.mark.alone]  # a short timeout of a real process, and stopped processes

# 48 layers of a small width: a 600-token prompt's step is 48 layers, each a small share of it
DEEP = ("--num-layers", "48", "--num-kv-heads", "4", "--head-dim", "64", "--block-size", "16",
        "--num-gpu-blocks", "48", "--max-num-batched-tokens", "1024", "--rank-timeout", "2")
RUN_S, STOPPED_S = 0.06, 0.18  # the worker's share of the machine: a quarter


@contextlib.contextmanager
def loaded(pid: int):
    """While inside, `pid` runs RUN_S out of every RUN_S + STOPPED_S seconds."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(STOPPED_S)
            os.kill(pid, signal.SIGCONT)
            done.wait(RUN_S)

    t = threading.Thread(target=cycle, name="load", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(5)
        os.kill(pid, signal.SIGCONT)


def test_a_deep_models_first_long_step_under_load_is_answered_while_its_worker_progresses(node, tmp_path):
    prompt = np.random.default_rng(3).integers(0, 512, 600).astype(np.int32)
    with launched(node, tmp_path, *DEEP) as ln:
        ln.client.generate(prompt[:8], 1, timeout=120)  # a short step first: too small to learn a speed from
        worker = next(p["pid"] for p in snapshot(node)["processes"] if p["role"] == "worker")
        with loaded(worker):
            first = ln.client.generate(prompt, 2, timeout=300)
        assert ln.proc.poll() is None, ln.logs()
        again = ln.client.generate(prompt[::-1].copy(), 2, timeout=120)
    assert first.finish_reason == again.finish_reason == "length" and len(first.output_token_ids) == 2
    assert first.computed_prompt_tokens == 600
