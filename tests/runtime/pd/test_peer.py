"""What both P/D sides share (runtime/pd/peer.py): refused peer messages are all counted but
logged at a bounded rate; a peer's key root is its own."""
from __future__ import annotations

import logging

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.runtime.pd.peer import Refusals, peer_key_root


def test_refusals_are_all_counted_and_logged_at_a_bounded_rate(caplog):
    stats = np.zeros(len(P.STAT), dtype=np.int64)
    refuse = Refusals(stats, every_s=3600.0, burst=5)
    with caplog.at_level(logging.WARNING, logger="kvrt.runtime.pd"):
        for i in range(20):
            refuse(f"bad {i}")
        assert stats[P.STAT["pd_refused"]] == 20
        assert [r.getMessage() for r in caplog.records] == [f"peer message refused: bad {i}" for i in range(5)]
        refuse._window_end = 0.0  # the next window
        refuse("bad 20")
    assert caplog.records[-1].getMessage() == "peer message refused: bad 20 (15 more refused, not logged)"


def test_each_peer_has_a_key_root_of_its_own():
    root = bytes(range(16))
    roots = {peer_key_root(root, name) for name in ("p0", "p1", "p0 ", "")}
    assert len(roots) == 4 and root not in roots and all(len(r) == 16 for r in roots)
    assert peer_key_root(root, "p0") == peer_key_root(root, "p0")
    assert peer_key_root(bytes(16), "p0") != peer_key_root(root, "p0")
