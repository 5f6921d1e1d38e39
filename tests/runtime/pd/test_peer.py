"""What both P/D sides share (runtime/pd/peer.py): refused peer messages are all counted and
logged through the rate-limiting log filter; a peer's key root is its own."""
from __future__ import annotations

import logging

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.log_limit import RateLimit
from kvrt.runtime.pd.peer import Refusals, peer_key_root


def test_refusals_are_all_counted_and_logged_at_the_log_filters_rate(caplog):
    stats = np.zeros(len(P.STAT), dtype=np.int64)
    refuse = Refusals(stats)
    now = [0.0]
    limit = RateLimit(interval_s=10.0, clock=lambda: now[0])
    caplog.handler.addFilter(limit)
    try:
        with caplog.at_level(logging.WARNING, logger="kvrt.runtime.pd"):
            for i in range(20):
                refuse(f"bad {i}")
            now[0] = 11.0
            refuse("bad 20")
    finally:
        caplog.handler.removeFilter(limit)
    assert stats[P.STAT["pd_refused"]] == 21
    assert [r.getMessage() for r in caplog.records] == [
        "peer message refused: bad 0", "peer message refused: bad 20 [and 19 more like it in the last 10 s]"]


def test_each_peer_has_a_key_root_of_its_own():
    root = bytes(range(16))
    roots = {peer_key_root(root, name) for name in ("p0", "p1", "p0 ", "")}
    assert len(roots) == 4 and root not in roots and all(len(r) == 16 for r in roots)
    assert peer_key_root(root, "p0") == peer_key_root(root, "p0")
    assert peer_key_root(bytes(16), "p0") != peer_key_root(root, "p0")
