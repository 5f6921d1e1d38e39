"""The `vllm:` Prometheus series of the HTTP server's /metrics, under the names and label a vLLM
Grafana dashboard reads.

Why here and not in the engine's registry: a vLLM user scrapes /metrics on the API port, and
these series describe what that API served. Two sources, each where the number is exact:

- per-request series (prompt and generation tokens, TTFT, inter-token latency, end-to-end
  latency, finished requests) are measured here, by the handlers, as a client of the API sees
  them; requests sent over the ZeroMQ client API are not in them;
- the engine's state (requests running and waiting, KV cache usage, prefix cache queries and
  hits) is read at scrape time from the node's ENGINE_STATS counters in shared memory, as
  `kvrt status` reads them, so it covers every request the engine holds, whichever API sent it.

The engine's own `kvrt_*` series stay on --metrics-port; /metrics relays them beside these.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

LABEL = "model_name"
# seconds; wide enough for a CPU node's slow first token and a GPU node's fast decode alike
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
               20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

StatsReader = Callable[[], "dict[str, float] | None"]


class VllmMetrics:
    """The registry of the `vllm:` series for one served model (its first name labels them all)."""

    def __init__(self, model_name: str, read_stats: StatsReader) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, [LABEL]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of the requests the API served",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "output tokens generated for the requests the "
                                         "API served", labels, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "requests the API served to their end, by finish reason",
                                [LABEL, "finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "from a request's arrival at the API to its first "
                              "output token", labels, registry=reg, buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "time between two answers of the engine to one "
                             "request (an answer may carry several tokens)", labels, registry=reg,
                             buckets=ITL_BUCKETS).labels(model_name)
        # the name dashboards written before inter_token_latency existed read; the same observations
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "the same observations as "
                              "vllm:inter_token_latency_seconds, under its older name", labels, registry=reg,
                              buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "from a request's arrival at the API to its last "
                             "token", labels, registry=reg, buckets=E2E_BUCKETS).labels(model_name)
        self.registry.register(_EngineCollector(model_name, read_stats))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int, seconds: float, finish_reason: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.e2e.observe(seconds)
        self._success.labels(self.model_name, finish_reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and prefix cache counters under vLLM's names, read at scrape time
    (no sample while the node's counters cannot be read: starting, or stopped)."""

    def __init__(self, model_name: str, read_stats: StatsReader) -> None:
        self._model = model_name
        self._read = read_stats

    def collect(self) -> Iterator:
        s = self._read()
        if s is None:
            return
        m = [self._model]

        def gauge(name: str, what: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, what, labels=[LABEL])
            g.add_metric(m, value)
            return g

        def counter(name: str, what: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, what, labels=[LABEL])
            c.add_metric(m, value)
            return c

        yield gauge("vllm:num_requests_running", "sequences the engine schedules steps for", s["seqs_running"])
        yield gauge("vllm:num_requests_waiting", "sequences waiting for blocks or for their KV to load from the "
                    "host or storage tier", s["seqs_waiting"] + s["seqs_loading"])
        usage = s["device_used"] / s["device_total"] if s["device_total"] > 0 else 0.0
        what = "share of the device KV blocks held by requests (cached blocks nobody holds count as free)"
        yield gauge("vllm:kv_cache_usage_perc", what, usage)
        yield gauge("vllm:gpu_cache_usage_perc", what + "; the older name of vllm:kv_cache_usage_perc", usage)
        yield counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache", s["query_tokens"])
        yield counter("vllm:prefix_cache_hits", "prompt tokens served from the device tier of the prefix cache",
                      s["hit_tokens_device"])
        yield counter("vllm:external_prefix_cache_queries", "prompt tokens looked up beyond the device tier "
                      "(host and storage)", s["query_tokens"] - s["hit_tokens_device"])
        yield counter("vllm:external_prefix_cache_hits", "prompt tokens served from the host or storage tier",
                      s["hit_tokens_host"] + s["hit_tokens_storage"])
