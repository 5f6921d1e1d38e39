"""Third-party load generators written for vLLM run against a node out of the box, given only
its URL and model id (and a workload): they look the tokenizer up by that id and read its
limits from /v1/models. Opt-in: each case runs only where its tool is on PATH (both pull in
torch or a large tree of their own, so they live in a virtualenv of their own; put its bin/ on
PATH to run these), and skips otherwise."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from kvrt.ipc.ports import free_port
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

REQUESTS = 5
RUN_TIMEOUT_S = 300


def _guidellm(exe: str, url: str, model: str, out: str) -> int:
    """Successful requests of a synchronous guidellm run (it finds the model through /v1/models)."""
    subprocess.run([exe, "run", "--backend", f"kind=openai_http,target={url}", "--profile", "kind=synchronous",
                    "--constraint", f"kind=max_requests,count={REQUESTS}",
                    "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8", "--output", "kind=json",
                    "--disable-progress"], cwd=out, check=True, timeout=RUN_TIMEOUT_S, capture_output=True)
    with open(os.path.join(out, "benchmarks.json")) as f:
        state = json.load(f)["benchmarks"][0]["scheduler_state"]
    assert state["errored_requests"] == 0, state
    return state["successful_requests"]


def _aiperf(exe: str, url: str, model: str, out: str) -> int:
    """Requests of a streamed chat aiperf run with no error."""
    subprocess.run([exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
                    "--request-count", str(REQUESTS), "--concurrency", "1", "--synthetic-input-tokens-mean", "32",
                    "--output-tokens-mean", "8", "--ui-type", "none", "--artifact-dir", out],
                   cwd=out, check=True, timeout=RUN_TIMEOUT_S, capture_output=True)
    (path,) = glob.glob(os.path.join(out, "**", "profile_export_aiperf.json"), recursive=True)
    with open(path) as f:
        report = json.load(f)
    assert not report.get("error_summary"), report["error_summary"]
    return int(report["request_count"]["avg"])


@pytest.mark.e2e
@pytest.mark.parametrize("tool,run", [("guidellm", _guidellm), ("aiperf", _aiperf)])
def test_a_load_generator_completes_against_a_node(tool, run, node, tmp_path):
    exe = shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed (pip install {tool}, then put its bin/ on PATH)")
    directory = tmp_path / "tiny-qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    http = free_port()
    out = tmp_path / "out"
    out.mkdir()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "256",
                  "--http-port", str(http)):
        _wait_healthy(http)
        assert run(exe, f"http://127.0.0.1:{http}", str(directory), str(out)) == REQUESTS
