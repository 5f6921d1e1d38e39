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
from typing import Callable, Iterator, Protocol

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
# the engine's phases of a request: from a millisecond up
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0, 1280.0, 2560.0)
# tokens per request: 1, 2, 5, 10, 20, 50, ... up to a million
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))
N_BUCKETS = (1, 2, 5, 10, 20)

StatsReader = Callable[[], "dict[str, float] | None"]


class EngineTimes(Protocol):
    """What the engine measured of a finished request (runtime/client/client.py's Result)."""

    engine_queue_ms: float
    engine_ttft_ms: float
    engine_e2e_ms: float


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

        def histogram(name: str, what: str, buckets: tuple):
            return Histogram(name, what, labels, registry=reg, buckets=buckets).labels(model_name)

        self.request_prompt = histogram("vllm:request_prompt_tokens", "prompt tokens of each finished request",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens", "output tokens of each finished "
                                            "request", TOKEN_BUCKETS)
        self.request_max_generation = histogram("vllm:request_max_num_generation_tokens", "the output tokens each "
                                                "finished request asked for at most (its max_tokens)", TOKEN_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "the max_tokens of each finished "
                                           "request", TOKEN_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "the n of each HTTP request (its choices)", N_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "from the engine's intake of a request to its first "
                               "step (waiting for room in a step or for blocks)", PHASE_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "from a request's first step to its first "
                                 "output token (its prompt's chunks, and KV loaded from the host or storage tier)",
                                 PHASE_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "from a request's first output token to its "
                                "last", PHASE_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "from a request's first step to its last "
                                   "token (prefill + decode)", PHASE_BUCKETS)
        self.registry.register(_EngineCollector(model_name, read_stats))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int, seconds: float, finish_reason: str,
                 max_tokens: int = 0, engine: EngineTimes | None = None) -> None:
        """A request the API served to its end: its tokens, its latency as the API saw it and, from
        `engine`, its phases in the engine (a request the engine never scheduled has none)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.e2e.observe(seconds)
        self._success.labels(self.model_name, finish_reason).inc()
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generated_tokens)
        if max_tokens:
            self.request_max_generation.observe(max_tokens)
            self.params_max_tokens.observe(max_tokens)
        if engine is not None and engine.engine_queue_ms > 0:
            queue, ttft, e2e = engine.engine_queue_ms / 1e3, engine.engine_ttft_ms / 1e3, engine.engine_e2e_ms / 1e3
            self.queue.observe(queue)
            if ttft > 0:
                self.prefill.observe(max(ttft - queue, 0.0))
                self.decode.observe(max(e2e - ttft, 0.0))
            self.inference.observe(max(e2e - queue, 0.0))

    def request(self, n: int) -> None:
        """An HTTP request asking for `n` choices per prompt."""
        self.params_n.observe(n)

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
        yield gauge("vllm:num_requests_swapped", "of the waiting sequences, those whose KV is loading from the "
                    "host or storage tier", s["seqs_loading"])
        usage = s["device_used"] / s["device_total"] if s["device_total"] > 0 else 0.0
        what = "share of the device KV blocks held by requests (cached blocks nobody holds count as free)"
        yield gauge("vllm:kv_cache_usage_perc", what, usage)
        yield gauge("vllm:gpu_cache_usage_perc", what + "; the older name of vllm:kv_cache_usage_perc", usage)
        host = s["host_used"] / s["host_total"] if s["host_total"] > 0 else 0.0
        yield gauge("vllm:cpu_cache_usage_perc", "share of the host-tier KV blocks held by requests (0 without a "
                    "host tier)", host)
        yield counter("vllm:num_preemptions", "sequences preempted (their blocks released, to run again)",
                      s["preemptions"])
        yield counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache", s["query_tokens"])
        yield counter("vllm:prefix_cache_hits", "prompt tokens served from the device tier of the prefix cache",
                      s["hit_tokens_device"])
        yield counter("vllm:external_prefix_cache_queries", "prompt tokens looked up beyond the device tier "
                      "(host and storage)", s["query_tokens"] - s["hit_tokens_device"])
        yield counter("vllm:external_prefix_cache_hits", "prompt tokens served from the host or storage tier",
                      s["hit_tokens_host"] + s["hit_tokens_storage"])
