"""`kvrt bench route`: every run starts from the nodes' caches reset, whatever ran before."""
from __future__ import annotations

import numpy as np

from kvrt.bench import route
from kvrt.runtime.client.replay import PromptSpec


class FakeFleet:
    """Records what the bench asks of the nodes, in order."""

    def __init__(self):
        self.nodes = [object(), object()]
        self.blocks = 10
        self.calls: list[str] = []
        self.held = 5  # blocks an earlier run left behind

    def reset_caches(self) -> None:
        self.calls.append("reset")
        self.held = 0

    def counters(self) -> tuple[int, int, list[int]]:
        self.calls.append("counters")
        return 0, 0, [0, 0]


def test_each_measured_run_starts_after_the_caches_were_reset(monkeypatch):
    fleet = FakeFleet()

    def send_all(base, specs, concurrency, timeout, text=False):
        fleet.calls.append(f"send held={fleet.held}")
        return {"ttfts": [1.0], "failed": [], "wall_s": 1.0}

    monkeypatch.setattr(route, "send_all", send_all)
    monkeypatch.setattr(route.time, "sleep", lambda s: None)
    args = route.parse_args(["--limit", "1"])
    specs = [PromptSpec(np.arange(8), 1, 0.0)]
    for _ in range(2):
        route.measure("round-robin", fleet, "http://x", specs, args, lambda line: None, None)
        fleet.held = 5  # the run left blocks behind
    assert fleet.calls == ["reset", "counters", "send held=0", "counters"] * 2
