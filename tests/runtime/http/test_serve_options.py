"""The HTTP server's options from vLLM's flags, each on the real app in process: the API key on
every route, the access and request logs, the chat template flag, the seed, and the stats line."""
from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.http.access_log import AccessLog
from kvrt.runtime.http.app import Server, create_app
from kvrt.runtime.http.auth import ApiKeyAuth
from kvrt.runtime.http.chat_template_flag import read_chat_template
from kvrt.runtime.node.stats_log import StatsLog, stats_line
from tests.runtime.http.test_http import MODEL, _FakeBridge

ROUTES = [("get", "/v1/models"), ("get", "/metrics"), ("get", "/version"),
          ("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/tokenize"),
          ("post", "/detokenize"), ("post", "/reset_prefix_cache"), ("get", "/kvrt/cache"), ("get", "/nowhere")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_needs_the_api_key(method, path):
    app = ApiKeyAuth(create_app(Server(_FakeBridge(True), MODEL)), "s3cret")
    with TestClient(app, raise_server_exceptions=False) as c:
        call = getattr(c, method)
        kw = {"json": {"prompt": [1], "max_tokens": 1}} if method == "post" else {}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret "}):
            r = call(path, headers=headers, **kw)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        r = call(path, headers={"Authorization": "Bearer s3cret"}, **kw)
        assert r.status_code != 401, r.text


def test_health_answers_without_the_key_as_vllms_does():
    """What probes a node (a load balancer, `kvrt route`) holds no client's key; only GET /health is open."""
    app = ApiKeyAuth(create_app(Server(_FakeBridge(True), MODEL)), "s3cret")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert c.post("/health").status_code == 401 and c.get("/health/").status_code == 401


def test_the_access_log_has_a_line_per_request_and_the_request_log_no_prompt(caplog):
    app = AccessLog(create_app(Server(_FakeBridge(True), MODEL)), access=True, requests=True)
    with caplog.at_level(logging.INFO, logger="kvrt.http"), TestClient(app, raise_server_exceptions=False) as c:
        c.get("/version")
        c.post("/v1/completions", json={"prompt": "a secret prompt", "max_tokens": 3, "temperature": 0.5})
    access = [r.getMessage() for r in caplog.records if r.name == "kvrt.http.access"]
    assert len(access) == 2 and '"GET /version HTTP/1.1" 200' in access[0] and '"POST /v1/completions' in access[1]
    logged = [r.getMessage() for r in caplog.records if r.name == "kvrt.http.requests"]
    assert len(logged) == 1 and '"max_tokens": 3' in logged[0] and '"temperature": 0.5' in logged[0]
    assert "secret" not in logged[0] and '"prompt": 17' in logged[0]


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(f)) == f.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        read_chat_template("{% for m in messages %}")


def _counters(**kw) -> dict:
    from kvrt.ipc.protocol import STATS

    base = dict.fromkeys(STATS, 0.0)
    base.update(device_total=100.0, host_total=200.0)
    base.update(kw)
    return base


def test_the_stats_line_says_throughput_queue_usage_and_hit_rate_per_tier():
    before = _counters()
    now = _counters(computed_prompt_tokens=500.0, generated_tokens=100.0, seqs_running=3, seqs_waiting=1,
                    seqs_loading=1, device_used=25.0, host_used=50.0, query_tokens=1000.0, hit_tokens_device=400.0,
                    hit_tokens_host=100.0)
    line = stats_line("n", before, now, 10.0)
    assert line == ("node n: prompt 50.0 tok/s, generation 10.0 tok/s | running 3, waiting 2 | KV usage device 25.0% "
                    "host 25.0% | prefix cache hit rate device 40.0% host 10.0% storage 0.0%")
    assert stats_line("n", now, now, 10.0) is not None  # requests still running: a line
    assert stats_line("n", before, before, 10.0) is None  # a quiet node: none


def test_the_stats_log_logs_from_its_reader(caplog):
    seen = iter([_counters(), _counters(generated_tokens=5.0, seqs_running=1)])
    last = _counters(generated_tokens=5.0, seqs_running=1)
    log = StatsLog("n", 0.01, read=lambda: next(seen, last))
    with caplog.at_level(logging.INFO, logger="kvrt.stats"):
        log.start()
        deadline = time.monotonic() + 30  # the thread's first line, however loaded the machine
        while not any(r.name == "kvrt.stats" for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
        log.stop()
    assert any("running 1" in r.getMessage() for r in caplog.records if r.name == "kvrt.stats")
