"""The trace statistics the development suite's families are matched on (bench/trace_shape.py),
on a trace small enough to count by hand, and the `sessions` family's shape: a fifth or so of
block accesses one-time, about half of the blocks back after their first use, and reuse gaps
that predict each other weakly."""
from __future__ import annotations

import numpy as np

from kvrt.bench.synthetic import synthetic
from kvrt.bench.trace_shape import shape, stack_quartiles
from kvrt.runtime.client.trace import TraceRequest


def test_shape_counts_what_it_says():
    # ids of 512 tokens, 8 blocks of 64 each
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 1024, 1, (1, 3)), TraceRequest(0, 512, 1, (1,)),
            TraceRequest(0, 512, 1, (4,)), TraceRequest(0, 512, 1, (1,))]
    s = shape(reqs)
    # blocks of id 1: 4 uses each (32 accesses); ids 2, 3 and 4: one use each (24 one-time accesses)
    assert s["one_time_access_share"] == 24 / 56
    assert s["first_use_back"] == 8 / 32 and s["used5_share"] == 0.0
    assert s["distinct_first_blocks"] == 2 and s["mean_blocks"] == (16 + 16 + 8 + 8 + 8) / 5
    # id 1 comes back with nothing used since (distance 0) twice, then after id 4's 8 blocks
    assert stack_quartiles(reqs).tolist() == [0.0, 0.0, 8.0]


def test_sessions_has_the_shape_it_is_made_for():
    s = shape(synthetic("sessions:100")[:2000])
    assert 0.1 < s["one_time_access_share"] < 0.3
    assert 0.4 < s["first_use_back"] < 0.7
    assert 0.2 < s["gap_correlation"] < 0.5
    assert 0.35 < s["distinct_first_blocks"] / s["requests"] < 0.6
    assert 180 < s["mean_blocks"] < 260
