"""Multiprocess ring stress: real producer processes, checksums, per-producer order, SIGKILL."""
import pytest

from kvrt.bench.stress_ring import build_parser, run_stress
from tests.conftest import leftovers

pytestmark = pytest.mark.e2e


def _run(node, *argv):
    args = build_parser().parse_args(["--node", node, *argv])
    return run_stress(args)


def test_many_producers_no_loss_no_dup_order_kept(node):
    res = _run(node, "--producers", "3", "--messages", "15000", "--capacity", str(1 << 15))
    assert res.ok, res.errors
    assert res.received == 45000 and res.got == {0: 15000, 1: 15000, 2: 15000}
    assert not leftovers(node)


def test_small_ring_heavy_backpressure(node):
    res = _run(node, "--producers", "2", "--messages", "5000", "--capacity", "4096", "--max-size", "2048")
    assert res.ok, res.errors
    assert res.received == 10000


@pytest.mark.alone  # it bounds the time to notice the dead producer
def test_sigkilled_producer_is_reported_and_ring_reused(node):
    res = _run(node, "--producers", "2", "--duration", "2", "--kill-after", "0.7")
    assert res.ok, res.errors
    assert res.dead_detected_s is not None and res.dead_detected_s < 5.0
    assert res.replacement_received > 0
    assert not leftovers(node)
