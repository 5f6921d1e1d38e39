"""What a new user meets on a first run: the metrics port, client commands against a wrong
port, exit codes, progress, `status --watch`, `--config`, replay defaults, and the plot."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvrt.ipc.protocol import STAT, STATS
from kvrt.runtime.engine.metrics import Metrics
from tests.conftest import REPO
from kvrt.ipc.ports import free_port
from tests.launched import tiny_trace


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
    server = Metrics(stats, dict).serve(port)
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and "kvrt_prefix_query_tokens" in body
        assert http_get(f"http://127.0.0.1:{port}/")[0] == 200
        for path in ("/health", "/v1/models", "/metricsx", "/metrics/x"):
            status, text = http_get(f"http://127.0.0.1:{port}{path}")
            assert status == 404 and "kvrt_" not in text, path
    finally:
        server.shutdown()
        server.server_close()
    samples = {}
    for line in body.splitlines():
        if line.startswith("kvrt_blocks"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert not any('state="total"' in k for k in samples)
    for tier, cap in (("device", 32), ("host", 16)):
        parts = sum(v for k, v in samples.items() if k.startswith("kvrt_blocks{") and f'tier="{tier}"' in k)
        assert parts == cap == samples[f'kvrt_blocks_capacity{{tier="{tier}"}}']


def kvrt(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture
def silent_listener():
    """A port that accepts TCP connections and never says anything (not a kvrt node)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                                     ["replay", "--limit", "2", "--trace", "TRACE"]])
def test_client_commands_name_a_wrong_port_long_before_their_answer_timeout(command, silent_listener, tmp_path):
    command = [tiny_trace(tmp_path / "trace.jsonl") if a == "TRACE" else a for a in command]
    closed = free_port()
    for port, why in ((closed, "refused"), (silent_listener, "")):
        # --timeout 600: only the connect check can end these runs within the subprocess timeout
        r = kvrt(*command, "--port", str(port), "--timeout", "600", timeout=60)
        assert r.returncode == 1, r.stderr
        assert f"tcp://127.0.0.1:{port}" in r.stderr and why in r.stderr


def read_for(fd: int, seconds: float, enough=lambda got: False) -> bytes:
    """What `fd` (a pty master or a pipe) gives within `seconds`, until it closes or `enough`."""
    import select
    import time

    got = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not enough(got):
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.e2e
def test_status_watch_redraws_in_place_on_a_terminal_and_appends_plain_frames_to_a_pipe():
    import pty

    args = [sys.executable, "-m", "kvrt.launcher", "status", "--node", "nosuchnode", "--watch", "0.2"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=REPO, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    try:
        tty = read_for(master, 30, lambda got: got.count(b"does not exist") >= 3).decode(errors="replace")
    finally:
        proc.kill()
        proc.wait(10)
        os.close(master)
    frames = tty.count("does not exist")
    assert frames >= 2 and tty.count("\x1b[H\x1b[2J") == frames
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        piped = read_for(proc.stdout.fileno(), 30, lambda got: got.count(b"does not exist") >= 3).decode()
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert piped.count("does not exist") >= 2 and "\x1b" not in piped


# ---- replay: what is taken from the trace, and prompts that do not fit -----------------------


def conversation_trace():
    """Six requests: conversation A (3 turns), B (2 turns), and a one-turn C, interleaved; all
    start with the shared id 0, as the bundled trace does."""
    from kvrt.runtime.client.trace import TraceRequest

    def req(t, ids):
        return TraceRequest(t, 512 * len(ids), 4, tuple(ids))

    return [req(0, [0, 1, 2]), req(1, [0, 9, 8]), req(2, [0, 5]), req(3, [0, 1, 2, 3]),
            req(4, [0, 9, 8, 7]), req(5, [0, 1, 2, 3, 4])]


def test_selecting_whole_conversations_keeps_reuse_at_a_small_limit():
    from kvrt.runtime.client.replay import select_conversations
    from kvrt.runtime.client.trace import ideal_hit_tokens
    from tests.runtime.client.test_demo_workload import scale_request

    reqs = conversation_trace()
    first = [scale_request(r, 8) for r in reqs[:3]]
    assert ideal_hit_tokens(first, 16, 8) == 0  # three first turns: nothing to reuse
    chosen, conversations = select_conversations(reqs, 3)
    assert conversations == 1 and [r.hash_ids[1] for r in chosen] == [1, 1, 1]
    assert ideal_hit_tokens([scale_request(r, 8) for r in chosen], 16, 8) > 0
    chosen, conversations = select_conversations(reqs, 5)
    assert conversations == 2 and chosen == [r for r in reqs if r.hash_ids[1] != 5]  # in trace order
    assert select_conversations(reqs, None) == (reqs, 3)  # the one-turn conversation comes last


def test_bench_replay_takes_whole_conversations_by_default_and_says_so():
    from kvrt.bench.replay import parse_args

    _, args = parse_args(["--trace", __file__])
    assert args.select == "conversations"


@pytest.mark.e2e
def test_replay_skips_prompts_longer_than_the_model_counts_them_and_cuts_none(tmp_path):
    import json

    from tests.runtime.client.test_client import FakeNode
    from tests.runtime.client.test_demo_workload import write_trace
    from kvrt.runtime.client.trace import TraceRequest

    trace = tmp_path / "t.jsonl"
    reqs = conversation_trace() + [TraceRequest(6, 512 * 9, 4, tuple(range(100, 109)))]  # 4,608 > 4,096 tokens
    write_trace(trace, reqs)
    with FakeNode() as f:
        r = kvrt("replay", "--port", str(f.port), "--trace", str(trace), "--tokens-per-id", "512", "--speed", "0",
                 "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["completed"] == out["requests"] == 6 and out["config"]["skipped_too_long"] == 1
        assert "skipping 1 of 7 requests longer than the node's max_model_len 4096" in r.stderr
        assert out["prompt_tokens"] == sum(q.input_length for q in reqs[:6])  # every prompt sent whole
        r = kvrt("replay", "--port", str(f.port), "--trace", str(trace), "--tokens-per-id", "512", "--speed", "0")
        assert r.returncode == 0 and "1 requests longer than max_model_len 4096" in r.stdout


def test_replay_defaults_scale_the_trace_to_fit_the_reference_model():
    from kvrt.ipc.config import NodeConfig
    from kvrt.runtime.client.replay import fit_requests, parser
    from kvrt.runtime.client.trace import default_trace_path, load_trace

    args = parser().parse_args(["--port", "1"])
    reqs = load_trace(default_trace_path(), 50)
    fits, too_long = fit_requests(reqs, args.tokens_per_id, NodeConfig(node="").max_model_len,
                                  args.max_new_tokens_cap)
    assert not too_long and len(fits) == 50


def test_bench_cache_plot_without_capacities_draws_a_curve(tmp_path, monkeypatch):
    """Without --capacity-blocks the plot gets capacities of its own: a curve, not an empty chart."""
    pytest.importorskip("matplotlib")
    import kvrt.bench.cache as bc
    from tests.runtime.client.test_demo_workload import write_trace

    drawn = []
    real_plot = bc.plot
    monkeypatch.setattr(bc, "plot", lambda results, path, trace: (drawn.append(results),
                                                                  real_plot(results, path, trace)))
    trace = tmp_path / "t.jsonl"
    write_trace(trace, conversation_trace())
    png = tmp_path / "hit.png"
    assert bc.main(["--trace", str(trace), "--plot", str(png)]) == 0
    capacities = [r["capacity_blocks"] for r in drawn[0]]
    assert len(capacities) >= 2 and None not in capacities and png.stat().st_size > 1000


# ---- kvrt launch --config ----------------------------------------------------------------------


@pytest.mark.e2e
def test_launch_config_file_sets_options_and_the_command_line_overrides_it(node, tmp_path):
    from tests.launched import launched

    cfg = tmp_path / "node.toml"
    cfg.write_text('num-gpu-blocks = 64\nblock_size = 8\nnum-layers = 2\nhead-dim = 16\n')
    with launched(node, tmp_path / "logs", "--config", str(cfg), "--num-gpu-blocks", "48") as ln:
        assert ln.client.info().block_size == 8  # from the file
        assert ln.engine_stats()["device_total"] == 48  # the flag wins over the file


@pytest.mark.e2e
@pytest.mark.parametrize("name, text, words", [
    ("a.toml", "num-gpu-blocks = 64\nnum-gpu-blokcs = 8\n", ["unknown key 'num-gpu-blokcs'"]),
    ("b.toml", 'num_gpu_blocks = "many"\n', ["key 'num_gpu_blocks' must be an integer", "'many'"]),
    ("c.toml", "demo = 1\n", ["key 'demo' must be true or false"]),
    ("d.toml", "pd-timeout = -3\n", ["--pd-timeout must be a positive number"]),  # the node's own check
    ("e.yaml", "role: router\n", ["key 'role' must be one of mixed, prefill, decode"]),
    ("f.toml", "num-gpu-blocks = \n", ["not valid TOML"]),
    ("g.yaml", "- 1\n- 2\n", ["must hold a table"]),
])
def test_launch_config_file_refuses_unknown_keys_and_wrong_types_naming_them(tmp_path, name, text, words):
    cfg = tmp_path / name
    cfg.write_text(text)
    r = kvrt("launch", "--config", str(cfg), "--num-layers", "2", timeout=60)
    assert r.returncode == 2, r.stderr
    for w in words + [str(cfg)] * (name != "d.toml"):
        assert w in r.stderr
    assert " ready: " not in r.stderr


# ---- exit codes ---------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("args, rc, words", [
    (["nosuchcommand"], 2, "invalid choice"),
    (["bench", "nosuch"], 2, "unknown name 'nosuch'"),
    (["status", "--node", "nosuchnode"], 1, "does not exist"),
    (["status", "--node", "bad/name"], 2, "invalid node name"),
    (["clean", "--node", "bad/name"], 2, "invalid node name"),
    (["launch", "--num-gpu-blocks", "0"], 2, "--num-gpu-blocks"),
    (["launch", "--config", "/nonexistent/node.toml"], 2, "cannot read it"),
    (["bench", "copy", "--e2e-blocks", "x"], 2, "--e2e-blocks must be comma-separated integers"),
    (["bench", "cache", "--trace", "/nonexistent.jsonl"], 2, "no such file"),
    (["replay", "--port", "0"], 2, "--port"),
])
def test_failing_commands_exit_nonzero_with_a_message_not_a_traceback(args, rc, words):
    r = kvrt(*args, timeout=60)
    assert r.returncode == rc and words in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.e2e
def test_launch_demo_shows_a_progress_bar_on_a_terminal():
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "launch", "--demo", "--num-layers", "2"], cwd=REPO,
                            stdout=slave, stderr=slave)
    os.close(slave)
    try:
        out = read_for(master, 120).decode(errors="replace")  # until the demo ends and closes the terminal
        assert proc.wait(30) == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(2)
            proc.wait(30)
        os.close(master)
    assert re.search(r"demo: 100%\|.*\| (\d+)/\1 \[", out), out[-3000:]
    assert "kvrt demo on node" in out


@pytest.mark.e2e
def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """`kvrt status --watch 1 | head -3`: head exits, kvrt's next write finds no reader."""
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "status", "--node", "nosuchnode", "--watch", "0.1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_for(proc.stdout.fileno(), 30, lambda got: b"does not exist" in got)
    proc.stdout.close()
    try:
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
