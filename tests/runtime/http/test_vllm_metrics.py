"""The `vllm:` series: the engine's counters under vLLM's names and meanings, and the API's own
per-request series, in Prometheus text with the `model_name` label."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvrt.ipc.protocol import STATS
from kvrt.runtime.http.vllm_metrics import VllmMetrics


def _samples(m: VllmMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            assert s.labels.get("model_name") == "m", s
            if not s.name.endswith(("_bucket", "_created")):
                key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
                out[key] = s.value
    return out


def test_the_engine_counters_under_vllm_names():
    stats = dict.fromkeys(STATS, 0.0) | {"seqs_running": 3, "seqs_waiting": 2, "seqs_loading": 1,
                                         "device_total": 200, "device_used": 50, "device_cached": 100,
                                         "query_tokens": 1000, "hit_tokens_device": 600, "hit_tokens_host": 100,
                                         "hit_tokens_storage": 50}
    s = _samples(VllmMetrics("m", lambda: stats))
    assert s["vllm:num_requests_running"] == 3 and s["vllm:num_requests_waiting"] == 3
    assert s["vllm:kv_cache_usage_perc"] == s["vllm:gpu_cache_usage_perc"] == 0.25, "cached blocks count as free"
    assert s["vllm:prefix_cache_queries_total"] == 1000 and s["vllm:prefix_cache_hits_total"] == 600
    assert s["vllm:external_prefix_cache_queries_total"] == 400
    assert s["vllm:external_prefix_cache_hits_total"] == 150


def test_the_api_series_move_with_each_request_and_no_engine_means_no_engine_series():
    m = VllmMetrics("m", lambda: None)
    m.first_token(0.2)
    m.next_tokens(0.01)
    m.next_tokens(0.02)
    m.finished(prompt_tokens=7, generated_tokens=3, seconds=0.5, finish_reason="length")
    m.finished(prompt_tokens=5, generated_tokens=1, seconds=0.1, finish_reason="stop")
    s = _samples(m)
    assert s["vllm:prompt_tokens_total"] == 12 and s["vllm:generation_tokens_total"] == 4
    assert s["vllm:time_to_first_token_seconds_count"] == 1 and s["vllm:time_to_first_token_seconds_sum"] == 0.2
    assert s["vllm:inter_token_latency_seconds_count"] == s["vllm:time_per_output_token_seconds_count"] == 2
    assert s["vllm:e2e_request_latency_seconds_count"] == 2
    assert s["vllm:request_success_total[length]"] == s["vllm:request_success_total[stop]"] == 1
    assert "vllm:num_requests_running" not in s
