"""Warnings of one kind at most once per interval, with a count of those held back
(ipc/log_limit.py), and a real node flooded with refused peer messages and invalid HTTP requests
logs a few lines, not one per message."""
from __future__ import annotations

import logging
import socket

import pytest
import zmq

from kvrt.ipc.log_limit import MAX_KINDS, RateLimit
from kvrt.ipc.ports import free_port
from kvrt.runtime.client.api import API
from kvrt.runtime.pd.messages import PdAbort
from tests.launched import SMALL, interrupt, launched


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(msg: str, *args, level: int = logging.WARNING, name: str = "kvrt.x") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_one_line_per_kind_per_interval_and_the_count_of_the_rest():
    clock = _Clock()
    f = RateLimit(10.0, clock)
    out = [r.getMessage() for r in (_record("refused: %s", i) for i in range(50)) if f.filter(r)]
    assert out == ["refused: 0"]
    assert f.filter(_record("another kind %d", 1)), "each kind has its own budget"
    assert f.filter(_record("refused: %s", "x", level=logging.INFO)), "INFO is not limited"
    assert all(f.filter(_record("refused: %s", i, level=logging.ERROR)) for i in range(3)), "nor is ERROR"
    clock.now = 10.0
    r = _record("refused: %s", "late")
    assert f.filter(r) and r.getMessage() == "refused: late [and 49 more like it in the last 10 s]"
    clock.now = 25.0
    r = _record("refused: %s", "alone")
    assert f.filter(r) and r.getMessage() == "refused: alone"


def test_messages_formatted_before_logging_do_not_grow_it_without_bound():
    f = RateLimit(10.0, _Clock())
    passed = sum(f.filter(_record(f"refused {i}")) for i in range(3 * MAX_KINDS))
    assert passed <= MAX_KINDS + 1 and len(f._kinds) <= MAX_KINDS + 1


@pytest.mark.e2e
@pytest.mark.alone
def test_a_flooded_node_logs_a_few_lines(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "32", "--http-port", str(http)) as ln:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{ln.port}")
        for i in range(500):  # a peer message outside a session: refused, and logged
            sock.send(API.encode(PdAbort(f"r{i}")))
        for _ in range(500):
            sock.recv()  # (each is answered: all were handled)
        sock.close()
        ctx.term()
        for _ in range(200):  # not HTTP at all: uvicorn logs "Invalid HTTP request received."
            with socket.create_connection(("127.0.0.1", http), timeout=10) as s:
                s.sendall(b"\x00\x01 junk\r\n\r\n")
                s.recv(1000)
        assert ln.client.generate([1, 2, 3], 2).output_token_ids.size == 2
        launcher = interrupt(ln.proc, "the node", 30)  # its own output: the HTTP server's log
        logs = ln.logs() + launcher
    refused = [ln_ for ln_ in logs.splitlines() if "unauthenticated PdAbort refused" in ln_]
    invalid = [ln_ for ln_ in logs.splitlines() if "Invalid HTTP request" in ln_]
    assert 1 <= len(refused) <= 3, refused
    assert 1 <= len(invalid) <= 3, invalid
