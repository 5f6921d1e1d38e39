"""What a new user meets on a first run: the metrics port, client commands against a wrong
port, exit codes, progress, `status --watch`, `--config`, replay defaults, and the plot."""
from __future__ import annotations

import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

from ipc.protocol import STAT, STATS
from runtime.metrics import Metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_port_answers_only_metrics_and_blocks_sum_to_capacity():
    stats = np.zeros(len(STATS), dtype=np.int64)
    for name, v in (("device_total", 32), ("device_free", 20), ("device_cached", 8), ("device_used", 4),
                    ("host_total", 16), ("host_free", 16)):
        stats[STAT[name]] = v
    port = free_port()
    Metrics(stats, dict).serve(port)
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and "kvrt_prefix_query_tokens" in body
    assert http_get(f"http://127.0.0.1:{port}/")[0] == 200
    for path in ("/health", "/v1/models", "/metricsx", "/metrics/x"):
        status, text = http_get(f"http://127.0.0.1:{port}{path}")
        assert status == 404 and "kvrt_" not in text, path
    samples = {}
    for line in body.splitlines():
        if line.startswith("kvrt_blocks"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert not any('state="total"' in k for k in samples)
    for tier, cap in (("device", 32), ("host", 16)):
        parts = sum(v for k, v in samples.items() if k.startswith("kvrt_blocks{") and f'tier="{tier}"' in k)
        assert parts == cap == samples[f'kvrt_blocks_capacity{{tier="{tier}"}}']
