"""One definition of every hit rate (runtime.cache.metrics.RATES): `kvrt status`, Prometheus
`/metrics`, the prefix cache's own counters and the replay client give the same number for the
same counts, and each Prometheus rate names its numerator and denominator."""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrt.ipc import protocol as P
from kvrt.runtime.cache.metrics import RATES, TIERS, CacheMetrics
from kvrt.runtime.client.replay import ReplayResult
from kvrt.runtime.engine.metrics import Metrics
from kvrt.runtime.node import status

# 1,000 prompt tokens of 10 requests: 400 from the device tier, 300 from host, 100 from storage
COUNTS = dict(requests=10, hit_requests=6, query_tokens=1000, hit_tokens_device=400, hit_tokens_host=300,
              hit_tokens_storage=100)
WANT = {"hit_token_rate": 0.8, "hit_token_rate_device": 0.4, "hit_token_rate_host": 0.3,
        "hit_token_rate_storage": 0.1, "request_hit_rate": 0.6}


def engine_stats(counts: dict) -> np.ndarray:
    stats = np.zeros(len(P.STATS))
    for name, v in counts.items():
        stats[P.STAT[name]] = v
    return stats


def scrape(stats: np.ndarray) -> dict:
    body = generate_latest(Metrics(stats, lambda: {}).registry).decode()
    return {f.name: f for f in text_string_to_metric_families(body)}


def test_status_prometheus_cache_and_replay_agree():
    from_status = status._engine(engine_stats(COUNTS))
    fams = scrape(engine_stats(COUNTS))
    tier_rates = {s.labels["tier"]: s.value for s in fams["kvrt_prefix_hit_rate"].samples}
    cache = CacheMetrics(requests=10, hit_requests=6, query_tokens=1000, query_tokens_host=600,
                         query_tokens_storage=300, hit_tokens_device=400, hit_tokens_host=300, hit_tokens_storage=100)
    replay = ReplayResult(prompt_tokens=1000, cached={"device": 400, "host": 300, "storage": 100})
    snap = cache.snapshot()
    for key, want in WANT.items():
        assert from_status[key] == pytest.approx(want), key
        assert snap[key] == pytest.approx(want), key
    for tier in TIERS:
        want = WANT[f"hit_token_rate_{tier}"]
        assert tier_rates[tier] == pytest.approx(want) and cache.hit_rate(tier) == pytest.approx(want), tier
        assert replay.hit_rate(tier) == pytest.approx(want), tier
    assert tier_rates["all"] == pytest.approx(0.8) and replay.hit_rate() == pytest.approx(0.8)
    assert fams["kvrt_request_hit_rate"].samples[0].value == pytest.approx(0.6)


def test_prometheus_help_names_numerator_and_denominator():
    fams = scrape(engine_stats(COUNTS))
    series = {s.name for f in fams.values() for s in f.samples}
    for r in RATES:
        family = "kvrt_request_hit_rate" if r.key == "request_hit_rate" else "kvrt_prefix_hit_rate"
        assert r.numerator_metric in fams[family].documentation, r.key
        assert r.denominator_metric in fams[family].documentation, r.key
        for metric in (r.numerator_metric, r.denominator_metric):  # the named series exist
            assert metric.split("{")[0].split(" ")[0] in series, metric


def test_no_rate_before_any_lookup():
    fams = scrape(np.zeros(len(P.STATS)))
    assert not fams["kvrt_prefix_hit_rate"].samples and not fams["kvrt_request_hit_rate"].samples
    assert status._engine(np.zeros(len(P.STATS)))["hit_token_rate"] is None
    assert CacheMetrics().hit_rate("host") is None and ReplayResult().hit_rate() is None
