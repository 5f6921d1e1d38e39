"""Third-party load generators written for vLLM run against `kvrt serve HUB_ID` out of the box,
given only its URL and model id (and a workload): they look the tokenizer up by that id in the
same Hugging Face cache (offline) and read its limits from /v1/models. Opt-in: each case runs
only where its tool is on PATH (both pull in torch or a large tree of their own, so they live in
a virtualenv of their own; put its bin/ on PATH to run these), and skips otherwise."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from tests.served import MODEL_ID, hub_env, serving

REQUESTS = 5
RUN_TIMEOUT_S = 300


def _guidellm(exe: str, url: str, model: str, out: str, env: dict) -> int:
    """Successful requests of a synchronous guidellm run (it finds the model through /v1/models)."""
    subprocess.run([exe, "run", "--backend", f"kind=openai_http,target={url}", "--profile", "kind=synchronous",
                    "--constraint", f"kind=max_requests,count={REQUESTS}",
                    "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8", "--output", "kind=json",
                    "--disable-progress"], cwd=out, check=True, timeout=RUN_TIMEOUT_S, capture_output=True, env=env)
    with open(os.path.join(out, "benchmarks.json")) as f:
        state = json.load(f)["benchmarks"][0]["scheduler_state"]
    assert state["errored_requests"] == 0, state
    return state["successful_requests"]


def _aiperf(exe: str, url: str, model: str, out: str, env: dict) -> int:
    """Requests of a streamed chat aiperf run with no error."""
    subprocess.run([exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
                    "--request-count", str(REQUESTS), "--concurrency", "1", "--synthetic-input-tokens-mean", "32",
                    "--output-tokens-mean", "8", "--ui-type", "none", "--artifact-dir", out],
                   cwd=out, check=True, timeout=RUN_TIMEOUT_S, capture_output=True, env=env)
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
    out = tmp_path / "out"
    out.mkdir()
    with serving(node, tmp_path) as (url, _):
        assert run(exe, url, MODEL_ID, str(out), hub_env(tmp_path / "hf")) == REQUESTS
