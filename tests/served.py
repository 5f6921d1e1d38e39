"""`kvrt serve` for end-to-end tests: a tiny checkpoint as a hub id's snapshot in a Hugging Face
cache of the test's own (the layout huggingface_hub reads), and the command in a subprocess on
a free port until a clean SIGINT stop that must exit 0.

    with serving(node, tmp_path, "--api-key", KEY) as (url, log):
        ...  # url: http://127.0.0.1:PORT (no /v1); log: the command's output file
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvrt.ipc.ports import free_port
from tests.conftest import REPO
from tests.hfkit import make_checkpoint
from tests.launched import interrupt
from tests.tokenizer_kit import make_tokenizer_dir

MODEL_ID = "Org/Tiny"
START_S = 60.0


def hub_cache(home, model_id: str = MODEL_ID) -> None:
    """A tiny Qwen2 checkpoint with its tokenizer as the main snapshot of `model_id` in a
    Hugging Face cache at `home` (HF_HOME)."""
    from huggingface_hub.file_download import repo_folder_name

    folder = home / "hub" / repo_folder_name(repo_id=model_id, repo_type="model")
    commit = "c" * 40
    snap = folder / "snapshots" / commit
    make_checkpoint(snap, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(snap)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def get(url: str, key: str | None = None) -> tuple[int, bytes]:
    """(status, body) of GET url; (0, b"") while nothing listens there."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def hub_env(home) -> dict[str, str]:
    """The environment of a process that reads the cache at `home` and never the network."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return env


@contextlib.contextmanager
def serving(node: str, tmp_path, *flags: str, key: str | None = None):
    """`kvrt serve MODEL_ID` (a small node: block size 8, 256 device blocks, 512 tokens) with
    `flags`, `key` as $VLLM_API_KEY; yields (base URL, output file) once /health answers."""
    home = tmp_path / "hf"
    hub_cache(home)
    port = free_port()
    out_path = tmp_path / "serve.log"
    env = hub_env(home)
    if key is not None:
        env["VLLM_API_KEY"] = key
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "serve", MODEL_ID, "--port", str(port),
                                 "--max-model-len", "512", "--node", node, "--block-size", "8",
                                 "--num-gpu-blocks", "256", *flags], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while get(f"http://127.0.0.1:{port}/health", key)[0] != 200:
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.1)  # a test waiting for another process
        yield f"http://127.0.0.1:{port}", out_path
    finally:
        interrupt(proc, "kvrt serve", 30)
