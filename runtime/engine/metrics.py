"""Prometheus metrics of a node, served by the engine on --metrics-port.

Why a custom collector: the engine already keeps its counters in the ENGINE_STATS signal
(for `kvrt status`, which must work even when the engine is hung). Reading that array at
scrape time gives Prometheus the same numbers with no second set of counters to keep in step.
The swap latency histogram is the one metric with its own state.
"""
from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvrt.ipc.protocol import STAT, STATS
from kvrt.runtime.cache.metrics import RATE, TIERS, rate

log = logging.getLogger(__name__)


class _StatsCollector:
    def __init__(self, stats, rings: Callable[[], dict[str, dict]]):
        self._stats = stats
        self._rings = rings

    def collect(self):
        s = self._stats
        hit = CounterMetricFamily("kvrt_prefix_hit_tokens", "prompt tokens served from a cache tier", labels=["tier"])
        for tier in ("device", "host", "storage"):
            hit.add_metric([tier], float(s[STAT[f"hit_tokens_{tier}"]]))
        yield hit
        yield CounterMetricFamily("kvrt_prefix_query_tokens", "prompt tokens looked up in the prefix cache",
                                  value=float(s[STAT["query_tokens"]]))
        yield CounterMetricFamily("kvrt_requests", "requests admitted", value=float(s[STAT["requests"]]))
        yield CounterMetricFamily("kvrt_prefix_hit_requests", "requests with at least one prompt token served "
                                  "from a cache tier", value=float(s[STAT["hit_requests"]]))
        yield from _rates({name: float(s[i]) for i, name in enumerate(STATS)})
        # The states partition a tier, so sum(kvrt_blocks) by tier is its capacity; the capacity
        # is a gauge of its own, never a fourth state that a sum would count twice.
        blocks = GaugeMetricFamily("kvrt_blocks", "KV blocks by tier and state (the states partition the tier)",
                                   labels=["tier", "state"])
        capacity = GaugeMetricFamily("kvrt_blocks_capacity", "KV blocks of a tier", labels=["tier"])
        for tier in ("device", "host"):
            for state in ("free", "cached", "used"):
                blocks.add_metric([tier, state], float(s[STAT[f"{tier}_{state}"]]))
            capacity.add_metric([tier], float(s[STAT[f"{tier}_total"]]))
        yield blocks
        yield capacity
        yield CounterMetricFamily("kvrt_swap_bytes", "bytes moved by cache-transfer tasks", value=float(s[STAT["swap_bytes"]]))
        yield CounterMetricFamily("kvrt_transfer_tasks_failed", "transfer tasks that failed or timed out",
                                  value=float(s[STAT["tasks_failed"]]))
        yield GaugeMetricFamily("kvrt_transfer_tasks_inflight", "transfer tasks in flight",
                                value=float(s[STAT["tasks_inflight"]]))
        for name, stat, what in (("kvrt_requests_finished", "finished_requests", "requests answered to the end"),
                                 ("kvrt_requests_failed", "failed_requests", "requests that ended in an error"),
                                 ("kvrt_generated_tokens", "generated_tokens", "output tokens sampled"),
                                 ("kvrt_prompt_tokens_computed", "computed_prompt_tokens",
                                  "prompt tokens not served by the prefix cache (each position once per request)"),
                                 ("kvrt_prompt_tokens_recomputed", "recomputed_prompt_tokens",
                                  "prompt tokens run again for a request after a preemption"),
                                 ("kvrt_preemptions", "preemptions", "sequences preempted for blocks"),
                                 ("kvrt_steps", "steps", "forward steps sent to the workers"),
                                 ("kvrt_pd_sent_bytes", "pd_sent_bytes", "KV bytes written into the decode node"),
                                 ("kvrt_pd_early_bytes", "pd_early_bytes",
                                  "KV bytes written into the decode node while their prefill still ran"),
                                 ("kvrt_storage_errors", "storage_errors",
                                  "storage failures (error returns, damaged objects, a dead store) answered as misses"),
                                 ("kvrt_storage_forged", "storage_forged",
                                  "storage objects without a valid MAC answered as misses (never served)")):
            yield CounterMetricFamily(name, what, value=float(s[STAT[stat]]))
        seqs = GaugeMetricFamily("kvrt_sequences", "sequences by scheduler state", labels=["state"])
        for state in ("running", "waiting", "loading"):
            seqs.add_metric([state], float(s[STAT[f"seqs_{state}"]]))
        yield seqs
        depth = GaugeMetricFamily("kvrt_ring_depth_bytes", "bytes waiting in a ring", labels=["ring"])
        for name, st in self._rings().items():
            depth.add_metric([name], float(st["depth_bytes"]))
        yield depth


def _rates(counters: dict[str, float]) -> Iterator[GaugeMetricFamily]:
    """The hit rates of runtime.cache.metrics.RATES, with their numerator and denominator series
    named in the help text; a rate whose denominator is still 0 has no sample (no NaN)."""
    by_tier = (*((t, f"hit_token_rate_{t}") for t in TIERS), ("all", "hit_token_rate"))
    tiers = GaugeMetricFamily(
        "kvrt_prefix_hit_rate", "share of the prompt tokens looked up that a cache tier served, cumulative "
        "since start; " + "; ".join(f'tier="{t}": {RATE[k].numerator_metric} / {RATE[k].denominator_metric}'
                                    for t, k in by_tier), labels=["tier"])
    for tier, key in by_tier:
        value = rate(counters, key)
        if value is not None:
            tiers.add_metric([tier], value)
    yield tiers
    r = RATE["request_hit_rate"]
    value = rate(counters, r.key)
    yield GaugeMetricFamily("kvrt_request_hit_rate", f"{r.what}: {r.numerator_metric} / {r.denominator_metric}, "
                            "cumulative since start", **({} if value is None else {"value": value}))


class Metrics:
    def __init__(self, stats, rings: Callable[[], dict[str, dict]]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats, rings))
        self.swap_seconds = Histogram("kvrt_transfer_task_seconds", "transfer task latency (all ranks)",
                                      ["kind"], registry=self.registry,
                                      buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10))
        self.ttft_seconds = Histogram("kvrt_ttft_seconds", "time from intake to the first token", registry=self.registry,
                                      buckets=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30))

    def serve(self, port: int) -> WSGIServer:
        """Serve the registry on 127.0.0.1:`port` from a daemon thread: `/metrics` (and `/`)
        answer, any other path is a 404, so a probe of `/health` or `/v1/models` is not fooled
        into reading metrics text as a success. Returns the server (shutdown() stops it)."""
        server = make_server("127.0.0.1", port, metrics_app(self.registry), _ThreadingServer, _QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
        return server


METRICS_PATHS = ("/metrics", "/")


def metrics_app(registry: CollectorRegistry) -> Callable:
    """A WSGI app: the registry's exposition on METRICS_PATHS, 404 elsewhere."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in METRICS_PATHS:
            return exposition(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: {path} (metrics are at /metrics)\n".encode()]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow scraper never holds up the next."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """Request lines go to the debug log, not to stderr."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("metrics http: " + format, *args)
