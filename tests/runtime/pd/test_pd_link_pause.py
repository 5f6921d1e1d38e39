"""A prefill node counts a decode node's silence in its own running time: P paused and resumed
keeps its sessions (D's answers queued meanwhile are still to be read), while a D that stays
silent as P runs is lost after the dead-after time, as before. The connector as a unit, with
a fake clock for its watch of the links."""
from __future__ import annotations

from kvrt.ipc.watchdog import Watchdog, pause_gap
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.prefill import PING_EVERY_S
from tests.runtime.pd.test_pd_choice import Harness


class FakeClock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def _round(h: Harness, clock: FakeClock, dt: float) -> None:
    """One turn of P's loop `dt` s after the last one: ping and check every link now."""
    clock.t += dt
    for link in h.p.links:
        link.next_ping = 0.0
    h.p.tick()


def test_a_paused_prefill_node_keeps_its_decode_nodes_and_still_loses_a_silent_one(tmp_path):
    h = Harness(tmp_path)
    clock = FakeClock()
    h.p.link_watch = Watchdog(pause_gap(h.p.dead_after, PING_EVERY_S), clock)
    _round(h, clock, 0.1)
    _round(h, clock, 10 * h.p.dead_after)  # P was paused: nothing from D read yet
    assert all(link.session is not None for link in h.p.links)
    assert not h.p.gone()
    for _ in range(round((h.p.dead_after + 1.0) / 0.1)):  # D 0 answers each ping, D 1 never
        h.from_d(0, wire.PdPong(0, 10))
        _round(h, clock, 0.1)
    assert h.p.links[0].session is not None
    assert h.p.links[1].session is None  # lost: no answer for dead_after of P's running time
