"""`kvrt serve` end to end, as a vLLM user runs it: a hub id from a local Hugging Face cache, an
API key, the official openai client (and LangChain's chat model, where installed) with only the
URL and the model id; the ready line, the stats line and the access log; and every series the
shipped Grafana dashboard queries, with data, from the live node's /metrics."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.conftest import REPO
from tests.served import MODEL_ID, get, serving

KEY = "test-key-123"
DASHBOARD = os.path.join(REPO, "docs", "grafana", "kvrt-node.json")
SERIES = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+)\s*[{\[]")


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    return get(url, key)


@pytest.fixture
def served(node, tmp_path):
    """`kvrt serve MODEL_ID` with an API key (from $VLLM_API_KEY) and vLLM flags kvrt takes as they
    are; yields (url, output file)."""
    with serving(node, tmp_path, "--disable-log-requests", "--trust-remote-code", "--log-stats-interval", "0.2",
                 key=KEY) as got:
        yield got


@pytest.mark.e2e
def test_kvrt_serve_serves_a_hub_id_to_the_openai_client_with_an_api_key(served):
    import openai

    url, out = served
    # /health answers once the engine does, a moment before the launcher has seen every child ready
    # and printed the ready line
    ready = f"serving '{MODEL_ID}' at {url}/v1"
    deadline = time.monotonic() + 30
    while ready not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # a test waiting for another process's output
    assert ready in out.read_text(), out.read_text()
    assert _get(f"{url}/v1/models", key=None)[0] == 401
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in oa.models.list().data] == [MODEL_ID]
    chat = oa.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                      max_completion_tokens=4, temperature=0, metadata={"a": "b"}, store=False,
                                      reasoning_effort="low")
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    chunks = list(oa.completions.create(model=MODEL_ID, prompt="hello", max_tokens=4, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True},
                                                    "priority": 0, "use_beam_search": False,
                                                    "add_special_tokens": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").models.list()
    time.sleep(1.0)  # two stats intervals after the load, for the stats line
    log = out.read_text()
    assert re.search(r'kvrt\.http\.access: 127\.0\.0\.1:\d+ "POST /v1/chat/completions HTTP/1\.1" 200', log), log
    assert re.search(r"generation [\d.]+ tok/s \| running \d+, waiting \d+ \| KV usage device", log), log


@pytest.mark.e2e
def test_every_panel_of_the_dashboard_has_data_from_a_node_under_load(served):
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = served
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    for i in range(3):  # the same prompt thrice: prefix cache hits too
        oa.completions.create(model=MODEL_ID, prompt="the same prompt again " * 4, max_tokens=3, temperature=0)
        list(oa.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": f"hi {i}"}],
                                        max_completion_tokens=3, stream=True))
    status, body = _get(f"{url}/metrics")
    assert status == 200
    samples = {s.name: s.value for fam in text_string_to_metric_families(body.decode())
               for s in fam.samples if s.labels.get("model_name") == MODEL_ID}
    with open(DASHBOARD) as f:
        panels = json.load(f)["panels"]
    missing = []
    for panel in panels:
        for target in panel["targets"]:
            for series in SERIES.findall(target["expr"]):
                if series not in samples:
                    missing.append(f"{panel['title']}: {series}")
                elif series.endswith("_bucket") and samples[series[:-len("_bucket")] + "_count"] <= 0:
                    missing.append(f"{panel['title']}: {series} has no observation")
    assert not missing, missing
    for counted in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_queue_time_seconds_count",
                    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                    "vllm:prefix_cache_queries_total"):
        assert samples[counted] > 0, counted


@pytest.mark.e2e
def test_langchains_chat_model_completes_with_the_url_and_model_id(served):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    url, _ = served
    llm = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model=MODEL_ID, max_tokens=4,
                                      temperature=0)
    answer = llm.invoke("hello")
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    pieces = list(llm.stream("hello"))
    assert pieces and all(hasattr(p, "content") for p in pieces)


VLLM_COMMAND_LINE = ["-tp", "1", "--enable-prefix-caching", "--dtype", "float32", "--kv-cache-dtype", "auto",
                     "--seed", "7", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                     "--gpu-memory-utilization", "0.5", "--swap-space", "0.001", "--served-model-name", "a", "b",
                     "--uvicorn-log-level", "info", "--disable-log-stats", "--enable-log-requests",
                     "--disable-uvicorn-access-log", "--enable-auto-tool-choice", "--enforce-eager",
                     "--generation-config", "vllm", "--load-format", "safetensors", "--disable-fastapi-docs"]


def _post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _sampled(url: str) -> list[list[int]]:
    """Two unseeded sampled completions (token ids), one after the other (a temperature that
    flattens the tiny random model's peaked distribution, so that seeds show)."""
    import openai

    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    return [oa.completions.create(model="b", prompt="hello", max_tokens=6, temperature=50.0).choices[0]
            .model_extra["token_ids"] for _ in range(2)]


@pytest.mark.e2e
def test_a_vllm_command_line_starts_a_node_that_does_what_its_flags_say(node, tmp_path):
    """The flags of the table together: the served names, the chat template, the host tier from
    --swap-space, the request log without the access log, and --seed: the same unseeded requests
    draw the same tokens on a second node started with the same seed."""
    import openai

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    runs = []
    for i in range(2):
        with serving(f"{node}{i}", tmp_path / str(i), *VLLM_COMMAND_LINE, "--chat-template", str(template)) \
                as (url, log):
            oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            assert [m.id for m in oa.models.list().data] == ["a"]
            rendered = _post(f"{url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
            assert rendered["tokens"] == _post(f"{url}/tokenize", {"prompt": "<<hi>>",
                                                                   "add_special_tokens": False})["tokens"]
            runs.append(_sampled(url))
            assert json.loads(_get(f"{url}/kvrt/cache", key=None)[1])["block_size"] == 8
            text = log.read_text()
        assert "kvrt.http.requests: /v1/completions" in text and "kvrt.http.access" not in text, text
        assert "256 device + 524 host blocks of 2048 bytes" in text, text  # 0.001 GiB of 2 KiB blocks
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1], runs


# the series vLLM's own Grafana dashboard for its server queries (its panels: E2E latency, token
# throughput, time per output token, scheduler state, TTFT, cache utilization, prompt and
# generation length, finish reason, queue time, prefill and decode time, max generation tokens)
VLLM_DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_swapped",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_bucket",
}


def test_the_shipped_dashboard_queries_every_series_vllms_dashboard_does():
    with open(DASHBOARD) as f:
        exprs = [t["expr"] for p in json.load(f)["panels"] for t in p["targets"]]
    ours = {s for e in exprs for s in SERIES.findall(e)}
    assert VLLM_DASHBOARD_SERIES <= ours, sorted(VLLM_DASHBOARD_SERIES - ours)
