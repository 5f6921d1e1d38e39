"""`kvrt serve` end to end, as a vLLM user runs it: a hub id from a local Hugging Face cache, an
API key, the official openai client (and LangChain's chat model, where installed) with only the
URL and the model id; the ready line, the stats line and the access log; and every series the
shipped Grafana dashboard queries, with data, from the live node's /metrics."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvrt.ipc.ports import free_port
from tests.conftest import REPO
from tests.hfkit import make_checkpoint
from tests.launched import interrupt
from tests.tokenizer_kit import make_tokenizer_dir

KEY = "test-key-123"
MODEL_ID = "Org/Tiny"
DASHBOARD = os.path.join(REPO, "docs", "grafana", "kvrt-node.json")
SERIES = re.compile(r"\b(vllm:[a-zA-Z_:]+)\s*[{\[]")
START_S = 60.0


def _hub_cache(home) -> None:
    """A tiny Qwen2 checkpoint as the snapshot of MODEL_ID in a Hugging Face cache at `home`."""
    from huggingface_hub.file_download import repo_folder_name

    folder = home / "hub" / repo_folder_name(repo_id=MODEL_ID, repo_type="model")
    commit = "c" * 40
    snap = folder / "snapshots" / commit
    make_checkpoint(snap, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(snap)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def _get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:  # not listening yet
        return 0, b""


@pytest.fixture
def served(node, tmp_path):
    """`kvrt serve MODEL_ID` on a free port with an API key; yields (url, output file)."""
    _hub_cache(tmp_path / "hf")
    port = free_port()
    out_path = tmp_path / "serve.log"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "VLLM_API_KEY": KEY}
    env.pop("HF_HUB_CACHE", None)
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "serve", MODEL_ID, "--port", str(port),
                                 "--max-model-len", "512", "--disable-log-requests", "--trust-remote-code",
                                 "--node", node, "--block-size", "8", "--num-gpu-blocks", "256",
                                 "--log-stats-interval", "0.2"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while _get(f"http://127.0.0.1:{port}/health")[0] != 200:
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.1)  # a test waiting for another process
        yield f"http://127.0.0.1:{port}", out_path
    finally:
        interrupt(proc, "kvrt serve", 30)


@pytest.mark.e2e
def test_kvrt_serve_serves_a_hub_id_to_the_openai_client_with_an_api_key(served):
    import openai

    url, out = served
    assert f"serving '{MODEL_ID}' at {url}/v1" in out.read_text()
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
