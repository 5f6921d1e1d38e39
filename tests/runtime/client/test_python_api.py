"""`import kvrt`: start a real node from Python, get the reference model's greedy tokens through
`node.client()`, and leave nothing behind; a bad flag is refused before anything starts."""
from __future__ import annotations

import re

import numpy as np
import psutil
import pytest

import kvrt
from tests.conftest import REPO, leftovers, run_py
from tests.launched import oracle

SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)


@pytest.mark.e2e
def test_launch_generate_stop(node, tmp_path):
    prompt = np.random.default_rng(5).integers(0, 512, 37).astype(np.int32)
    want = oracle().generate_dense(prompt, 6)
    with kvrt.launch(node=node, num_gpu_blocks=64, log_dir=tmp_path, **SMALL) as n:
        assert leftovers(node), "a running node has its shared memory"
        pids = [n.pid] + [c.pid for c in psutil.Process(n.pid).children(recursive=True)]
        with n.client() as c:
            got = c.generate(prompt, 6)
            assert got.output_token_ids.tolist() == want
        sampled = n.client().generate(prompt, 6, sampling=kvrt.Sampling(temperature=0.8, seed=3))
        assert len(sampled.output_token_ids) == 6
    assert n.returncode == 0, n.log_tail()
    assert not n.alive() and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                     for p in pids)
    assert not leftovers(node)


@pytest.mark.e2e
def test_bad_flag_is_refused_before_anything_starts(node, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="--num-gpu-blockz"):
        kvrt.launch(node=node, num_gpu_blockz=64)
    with pytest.raises(ValueError, match="--role.*invalid choice"):
        kvrt.launch(node=node, role="both")
    with pytest.raises(ValueError, match="--tp.*invalid int"):
        kvrt.launch(node=node, tp="two")
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    assert not leftovers(node)


@pytest.mark.e2e
def test_a_node_that_fails_to_start_raises_with_its_output(node, tmp_path):
    """The launcher's own checks (past the parser) fail: the error carries its output."""
    with pytest.raises(kvrt.LaunchError) as e:
        kvrt.launch(node=node, model=tmp_path / "missing", start_timeout=60)
    assert node in str(e.value) and "missing" in str(e.value)
    assert not leftovers(node)


def test_client_is_the_runtime_client():
    from kvrt.runtime.client.client import Client, Sampling

    assert kvrt.Client is Client and kvrt.Sampling is Sampling


@pytest.mark.e2e
def test_packages_in_the_working_directory_are_not_imported(node, tmp_path, monkeypatch):
    """A caller in a folder with its own `runtime/` or `launcher.py` still starts kvrt's node."""
    for pkg in ("workers", "runtime", "ipc"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("raise SystemExit(97)\n")
    (tmp_path / "launcher.py").write_text("raise SystemExit(97)\n")
    monkeypatch.chdir(tmp_path)
    with kvrt.launch(node=node, num_gpu_blocks=16, **SMALL) as n:
        assert n.client().generate([1, 2, 3], 2).output_token_ids.tolist() == oracle().generate_dense(
            np.array([1, 2, 3]), 2)
    assert n.returncode == 0, n.log_tail()


@pytest.mark.e2e
def test_readme_example_runs():
    """The README's Python API example, verbatim, in a fresh interpreter."""
    text = open(f"{REPO}/README.md").read()
    code = re.search(r"### Python API\n.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 5
    r = run_py(code, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[" in r.stdout and "]" in r.stdout


@pytest.mark.e2e
def test_a_node_that_does_not_answer_in_time_is_killed_and_reclaimed(node):
    """No answer within start_timeout: the error names the wait, and the half-started node is
    killed with its processes and shared memory."""
    with pytest.raises(kvrt.LaunchError, match=f"node {node} did not answer an info request on tcp://"):
        kvrt.launch(node=node, start_timeout=0.01, **SMALL)
    assert not [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
    assert not leftovers(node)


@pytest.mark.e2e
def test_a_node_that_does_not_stop_in_time_is_killed_with_its_processes(node):
    """stop() bounded: past stop_timeout the launcher and every process it started are killed
    and the node's shared memory reclaimed, and the error says what it waited for."""
    n = kvrt.launch(node=node, stop_timeout=0, **SMALL)
    tree = psutil.Process(n.pid).children(recursive=True)
    assert tree, "a ready node has its engine and worker processes"
    with pytest.raises(kvrt.LaunchError, match=f"node {node} did not exit within 0 s of SIGINT"):
        n.stop()
    assert not any(p.is_running() and p.status() != "zombie" for p in tree)
    assert not leftovers(node)


def test_keywords_become_launch_flags():
    from kvrt.runtime.client.launch import check_launch_argv, launch_argv

    argv = launch_argv({"num_gpu_blocks": 64, "ready_timeout": 5.5, "storage": None, "demo": False,
                        "log_dir": "logs"})
    assert argv == ["--num-gpu-blocks", "64", "--ready-timeout", "5.5", "--log-dir", "logs"]
    args = check_launch_argv(argv)
    assert (args.num_gpu_blocks, args.ready_timeout, args.log_dir) == (64, 5.5, "logs")
