"""`kvrt route`'s /metrics: the router's own Prometheus series, for the dashboards that watch a
fleet from its front door.

Why read at scrape time from the router's state (the backends' table) rather than kept as
counters beside it: the state is what /health shows, so the two never disagree, and routing a
request costs nothing more than it did. The requests answered are the one counter kept here (by
endpoint and status), bumped once per answer.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvrt.runtime.router.backends import Backends

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    """The registry of the `kvrt_router_*` series."""

    def __init__(self, backends: Backends, policy: str) -> None:
        self.registry = CollectorRegistry()
        self._answered = Counter("kvrt_router_requests", "requests the router answered, by endpoint and HTTP status",
                                 ["endpoint", "status"], registry=self.registry)
        self.registry.register(_BackendCollector(backends, policy))

    def answered(self, endpoint: str, status: int) -> None:
        self._answered.labels(endpoint, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _BackendCollector:
    """Each backend's state as /health shows it, labelled by its URL."""

    def __init__(self, backends: Backends, policy: str) -> None:
        self._backends = backends
        self._policy = policy

    def collect(self) -> Iterator:
        import time

        now = time.monotonic()
        families = {
            "healthy": GaugeMetricFamily("kvrt_router_backend_healthy", "1 while the backend passes its health "
                                         "checks", labels=["backend"]),
            "slow": GaugeMetricFamily("kvrt_router_backend_slow", "1 while the backend is avoided after a timeout",
                                      labels=["backend"]),
            "inflight": GaugeMetricFamily("kvrt_router_backend_inflight", "requests the router has at the backend",
                                          labels=["backend"]),
            "routed": CounterMetricFamily("kvrt_router_routed", "requests the router sent to the backend and it took",
                                          labels=["backend"]),
            "cached": GaugeMetricFamily("kvrt_router_backend_cached_blocks", "blocks the router's view of the "
                                        "backend's KV events holds", labels=["backend"]),
            "gaps": CounterMetricFamily("kvrt_router_kv_events_gaps", "gaps in the backend's KV event numbers",
                                        labels=["backend"]),
            "lost": CounterMetricFamily("kvrt_router_kv_events_lost", "KV event batches of the backend never "
                                        "recovered", labels=["backend"]),
        }
        for b in self._backends.items:
            label = [b.url]
            families["healthy"].add_metric(label, float(b.healthy))
            families["slow"].add_metric(label, float(b.slow_until > now))
            families["inflight"].add_metric(label, float(b.inflight))
            families["routed"].add_metric(label, float(b.routed))
            if b.view is not None:
                families["cached"].add_metric(label, float(len(b.view.media)))
                families["gaps"].add_metric(label, float(b.view.gaps))
                families["lost"].add_metric(label, float(b.view.lost))
        policy = GaugeMetricFamily("kvrt_router_info", "the router's routing policy", labels=["policy"])
        policy.add_metric([self._policy], 1.0)
        yield policy
        yield from families.values()
