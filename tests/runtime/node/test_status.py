"""`kvrt status` tells the truth about a node whatever state it is in: a dead launcher is a dead
node, damaged shared memory is reported (not a crash), and `--json` is strict JSON."""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import psutil
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.registry import Registry, process_start_ms
from kvrt.ipc.signals import Signal
from kvrt.runtime.node import status
from tests.runtime.node.test_launch import Launched, kvrt


def strict_json(text: str) -> dict:
    def refuse(name: str):
        raise AssertionError(f"--json printed {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.e2e
def test_a_sigkilled_launcher_shows_a_dead_node(node):
    n = Launched(node)
    try:
        n.wait_for("ready:")
        snap = n.status()
        assert snap["state"] == "running"
        children = [psutil.Process(p["pid"]) for p in snap["processes"]]
        n.proc.send_signal(signal.SIGKILL)
        n.proc.wait(10)
        psutil.wait_procs(children, timeout=10)
        r = kvrt("status", "--node", node, "--json")
        assert r.returncode == 0, r.stderr
        dead = strict_json(r.stdout)["nodes"][0]
        assert dead["state"] == status.DEAD
        assert snap["launcher_heartbeat_age_s"] is not None  # the live launcher did beat
        assert f"state {status.DEAD}" in kvrt("status", "--node", node).stdout
    finally:
        n.stop()
        kvrt("clean", "--node", node)


@pytest.fixture
def damaged_node(node):
    """A node whose launcher (this process) lives but whose shared memory is damaged: a config
    segment that is not msgpack, NaN counters, heartbeats ahead of the clock."""
    reg = Registry.create(node)
    try:
        seg = reg.create_segment(P.CONFIG, 16, meta={"format": "msgpack"})
        seg.mm[:8] = (5).to_bytes(8, "little")
        seg.mm[8:13] = b"\xc1" * 5  # a byte msgpack never uses
        seg.close()
        sigs = [Signal.create(reg, P.PROCS, (2, P.PROC_FIELDS), np.int64), Signal.create(reg, P.HEARTBEAT, 2, np.int64),
                Signal.create(reg, P.READY, 2, np.int32), Signal.create(reg, P.NODE_STATUS, P.STATUS_FIELDS, np.int64),
                Signal.create(reg, P.ENGINE_STATS, len(P.STATS), np.float64)]
        procs, beats, _, word, stats = (s.array for s in sigs)
        pid = os.getpid()
        for slot, role in enumerate((P.ROLE_ENGINE, P.ROLE_WORKER)):
            procs[slot, :P.PROC_STEP] = (pid, role, 0, process_start_ms(pid))
        now = time.monotonic_ns()
        beats[:] = (now + 500_000_000, now + 3600 * 10**9)  # written just after status read the clock; garbage
        word[P.ST_NODE] = P.NODE_RUNNING
        word[P.ST_LAUNCHER_BEAT] = now
        stats[:] = np.nan
        yield node
    finally:
        for s in sigs:
            s.close()
        reg.unlink_all()


@pytest.mark.e2e
def test_damaged_shared_memory_is_reported_not_a_crash(damaged_node):
    r = kvrt("status", "--node", damaged_node, "--json")
    assert r.returncode == 0, r.stderr
    snap = strict_json(r.stdout)["nodes"][0]
    assert snap["state"] == status.DAMAGED and snap["launcher_alive"]
    assert snap["config"] == {} and any(d.startswith("config") for d in snap["damaged"])
    ages = [p["heartbeat_age_s"] for p in snap["processes"]]
    assert ages[0] is not None and ages[0] >= 0 and ages[1] is None, ages
    assert snap["engine"]["requests"] is None and snap["engine"].get("hit_token_rate") is None
    text = kvrt("status", "--node", damaged_node)
    assert text.returncode == 0 and "damaged: config" in text.stdout, text.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("watch", ["-1", "nan"])
def test_a_bad_watch_interval_is_refused_at_parsing(damaged_node, watch):
    r = kvrt("status", "--node", damaged_node, "--watch", watch)
    assert r.returncode == 2 and "--watch" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_state_follows_the_launcher():
    assert status._state(False, "running", 0.1, False) == status.DEAD
    assert status._state(True, "running", 0.1, True) == status.DAMAGED
    assert status._state(True, "running", 0.1, False) == "running"
    assert status._state(True, "running", status.LAUNCHER_STALE_S + 1, False).startswith("unresponsive")
    assert status._state(True, "starting", None, False) == "starting"
    assert status._age_s(10**9, 0) is None
    assert status._age_s(10**9, 10**9 + 10**6) == 0.0
    assert status._age_s(3 * 10**9, 10**9) == 2.0


def test_no_rate_is_nan_before_any_request():
    e = status._engine(np.zeros(len(P.STATS)))
    assert e["hit_token_rate_device"] is None and e["request_hit_rate"] is None
    json.dumps(status._json_safe({"x": [float("nan"), float("inf"), 1.5]}), allow_nan=False)
