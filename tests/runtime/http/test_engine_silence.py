"""Supervision of the HTTP path on real nodes: an HTTP client with a request in flight gets an
error within a bounded time, not a hang, when the engine stops answering (SIGSTOP: the node's
HTTP server fails the request after --http-engine-timeout, naming the silent engine) or when the
launcher that hosts the HTTP server is stopped (the router cuts the stream after
--backend-timeout). After SIGCONT the node serves again."""
from __future__ import annotations

import contextlib
import os
import signal

import openai
import pytest

from kvrt.ipc.ports import free_port
from tests.runtime.http.test_http import MODEL, _wait_healthy
from tests.runtime.http.test_stream_failures import SMALL, _last_event, _recording_client
from tests.runtime.node.test_launch import launched  # noqa: F401  (the fixture)
from tests.runtime.router.test_router import routing

# the 2 s bounds (--http-engine-timeout, --backend-timeout) are waited out on a stopped process;
# a running one sends far more often (the engine a probe every 0.5 s, a stream its tokens): the
# same margin as every client's own liveness window (4 probe intervals), so not `alone`
pytestmark = pytest.mark.e2e

LONG = 3000


@contextlib.contextmanager
def _stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _stream_stopping(oa: openai.OpenAI, pid: int, stack: contextlib.ExitStack) -> openai.APIError:
    """Stream a LONG completion and SIGSTOP `pid` once its first chunk is in (SIGCONT when
    `stack` closes): the error the client raised (it must raise, the client's own timeout is
    far above the server's)."""
    stream = oa.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=LONG, temperature=0, stream=True)
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 0:
                stack.enter_context(_stopped(pid))
    return e.value


def test_a_stopped_engine_fails_the_http_stream_naming_it_and_the_node_serves_after(launched):  # noqa: F811
    http = free_port()
    n = launched("--port", str(free_port()), "--http-port", str(http), *SMALL, "--hang-timeout", "600",
                 "--http-engine-timeout", "2")
    n.wait_for("ready:")
    _wait_healthy(http)
    engine = n.child_pids()["engine[0]"]
    oa, rec = _recording_client(f"http://127.0.0.1:{http}")
    with contextlib.ExitStack() as stopped:
        err = _stream_stopping(oa, engine, stopped)
    assert "sent nothing" in err.message and "--http-engine-timeout" in err.message, err.message
    assert _last_event(bytes(rec.body))["error"]["code"] == "engine_unresponsive"
    assert b"data: [DONE]" not in rec.body
    again = oa.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=3, temperature=0)
    assert len(again.choices[0].model_extra["token_ids"]) == 3  # resumed: served again
    assert n.proc.poll() is None


def test_a_stopped_launcher_ends_the_routers_stream_after_the_backend_timeout(launched):  # noqa: F811
    http = free_port()
    n = launched("--port", str(free_port()), "--http-port", str(http), *SMALL, "--hang-timeout", "600")
    n.wait_for("ready:")
    _wait_healthy(http)
    with routing([f"http://127.0.0.1:{http}"], "round-robin", "--backend-timeout", "2") as base:
        oa, rec = _recording_client(base)
        with contextlib.ExitStack() as stopped:
            err = _stream_stopping(oa, n.proc.pid, stopped)  # the launcher, and the HTTP server in it
        assert "--backend-timeout" in err.message and f"127.0.0.1:{http}" in err.message, err.message
        assert b"data: [DONE]" not in rec.body
    _wait_healthy(http)
    assert n.proc.poll() is None
