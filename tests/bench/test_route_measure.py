"""`kvrt bench route`: every run starts from the nodes' caches reset, whatever ran before; the
hit rates come from the nodes' counters over the run, per node and summed."""
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
        self.asked, self.hit, self.done = [100, 50], [10, 0], [3, 4]

    def reset_caches(self) -> None:
        self.calls.append("reset")
        self.held = 0

    def counters(self) -> tuple[list[int], list[int], list[int]]:
        self.calls.append("counters")
        return list(self.asked), list(self.hit), list(self.done)


def test_each_measured_run_starts_after_the_caches_were_reset(monkeypatch):
    fleet = FakeFleet()

    def send_all(base, specs, concurrency, timeout, text=False):
        fleet.calls.append(f"send held={fleet.held}")
        fleet.asked, fleet.hit, fleet.done = [fleet.asked[0] + 80, fleet.asked[1] + 20], [fleet.hit[0] + 8, 1], [4, 5]
        return {"ttfts": [1.0], "failed": [], "wall_s": 1.0}

    monkeypatch.setattr(route, "send_all", send_all)
    monkeypatch.setattr(route.time, "sleep", lambda s: None)
    args = route.parse_args(["--limit", "1"])
    specs = [PromptSpec(np.arange(8), 1, 0.0)]
    rows = []
    for _ in range(2):
        rows.append(route.measure("round-robin", fleet, "http://x", specs, args, lambda line: None, None))
        fleet.held = 5  # the run left blocks behind
    assert fleet.calls == ["reset", "counters", "send held=0", "counters"] * 2
    first = rows[0]
    assert first["prompt_tokens"] == 100 and first["hit_token_rate"] == 9 / 100
    assert first["hit_rate_per_node"] == [8 / 80, 1 / 20] and first["routed_per_node"] == [1, 1]
