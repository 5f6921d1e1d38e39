"""`kvrt serve`: vLLM's command line becomes a `kvrt launch` one that kvrt's own parser takes,
every vLLM flag without a counterpart is refused naming it, the model is found in a Hugging Face
cache laid out by huggingface_hub's own functions, and a node nobody could reach is refused.
In process: nothing here starts a node."""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os

import pytest

from kvrt import launcher
from kvrt.runtime.client.launch import check_launch_argv
from kvrt.runtime.node import vllm_flags
from kvrt.runtime.node.serve import ServeError, plan
from tests.conftest import REPO

PORT = 17001  # the internal port plan() is given (nothing binds it here)


def _launch_flags() -> set[str]:
    launch = launcher._add_launch(argparse.ArgumentParser(prog="kvrt").add_subparsers())
    return {s for a in launch._actions for s in a.option_strings}


FLAGS = _launch_flags()


@pytest.fixture
def checkpoint(tmp_path):
    """A directory standing for a checkpoint (plan() only resolves it; launch checks it)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding Org/Tiny at main and at a tag, written by huggingface_hub's
    own cache functions (a real download's layout), with HF_HOME pointing at it."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision, repo_folder_name

    home = tmp_path / "hf"
    cache = home / "hub"
    folder = cache / repo_folder_name(repo_id="Org/Tiny", repo_type="model")
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, commit in commits.items():
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commits["main"])
    _cache_commit_hash_for_specific_revision(str(folder), "v1", commits["v1"])
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert constants.HF_HUB_CACHE  # (read at import; kvrt reads the environment at each call)
    return folder, commits


def _plan(*argv: str, environ: dict | None = None):
    return plan(list(argv), FLAGS, environ={} if environ is None else environ, internal_port=PORT)


def test_a_vllm_command_line_becomes_a_launch_command_line_kvrt_takes(checkpoint):
    p = _plan(checkpoint, "--tensor-parallel-size", "1", "--enable-prefix-caching", "--dtype", "bfloat16",
              "--kv-cache-dtype", "auto", "--api-key", "k", "--seed", "7", "--disable-log-requests",
              "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--block-size", "8",
              "--gpu-memory-utilization", "0.5", "--swap-space", "1", "--served-model-name", "a", "b",
              "--trust-remote-code", "--uvicorn-log-level", "info", "--disable-log-stats", "--enable-log-requests",
              "--disable-uvicorn-access-log", "--host", "0.0.0.0", "--port", "9000", "--chat-template", "{{ x }}")
    args = check_launch_argv(p.launch_argv)
    assert (args.model, args.port, args.host, args.http_host, args.http_port) == (checkpoint, PORT, "127.0.0.1",
                                                                                 "0.0.0.0", 9000)
    assert (args.tp, args.compute_dtype, args.api_key, args.seed, args.max_model_len, args.max_num_seqs,
            args.max_num_batched_tokens, args.block_size, args.gpu_memory_utilization, args.swap_space) == \
        (1, "bfloat16", "k", 7, 256, 8, 128, 8, 0.5, 1.0)
    assert (args.served_model_name, p.model_id, args.uvicorn_log_level) == (["a", "b"], "a", "info")
    assert (args.log_stats_interval, args.log_requests, args.access_log, args.chat_template) == \
        (0.0, True, False, "{{ x }}")


def test_the_defaults_are_vllms(checkpoint):
    args = check_launch_argv(_plan(checkpoint).launch_argv)
    assert (args.http_port, args.http_host, args.served_model_name) == (8000, "127.0.0.1", [checkpoint])
    assert (args.access_log, args.log_stats_interval, args.compute_dtype, args.api_key) == (True, 10.0, "auto", None)
    assert check_launch_argv(_plan(checkpoint, environ={"VLLM_API_KEY": "s"}).launch_argv).api_key == "s"


def test_the_http_engine_timeouts_default_is_the_bridges(checkpoint):
    """The launcher names the bridge's default without importing the HTTP stack: the same number."""
    from kvrt.runtime.http.bridge import ENGINE_TIMEOUT_S

    assert check_launch_argv(_plan(checkpoint).launch_argv).http_engine_timeout == ENGINE_TIMEOUT_S


@pytest.mark.parametrize("flag, field, module, default", [
    ("--http-stall-timeout", "stall_timeout", "kvrt.runtime.http.stalled", "STALL_S"),
    ("--http-idle-timeout", "idle_timeout", "kvrt.runtime.http.connections", "IDLE_S")])
def test_the_http_timeouts_are_the_servers_bounds_unless_given(flag, field, module, default):
    """--http-stall-timeout, --http-idle-timeout: the server's own bound when not given (the
    number its help names), a finite number of seconds > 0 when given, anything else refused by
    name."""
    import importlib

    from kvrt.runtime.http.server import HttpOptions

    bound = getattr(importlib.import_module(module), default)
    launch = launcher._add_launch(argparse.ArgumentParser(prog="kvrt").add_subparsers())
    help_ = next(a.help for a in launch._actions if flag in a.option_strings)
    assert f"default {bound:g} s" in help_
    assert getattr(HttpOptions.of(launch.parse_args([])), field) == bound
    assert getattr(HttpOptions.of(launch.parse_args([flag, "0.5"])), field) == 0.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=flag):
            HttpOptions.of(launch.parse_args([flag, bad]))


def test_the_kv_events_replay_rate_is_the_publishers_unless_given():
    """--kv-events-replay-rate: 0 (REPLAY_PER_S, the number its help names) when not given; a
    negative or non-finite rate is refused by name."""
    from kvrt.runtime.cache.events import REPLAY_PER_S
    from kvrt.runtime.node.config import ConfigError, NodeConfig

    launch = launcher._add_launch(argparse.ArgumentParser(prog="kvrt").add_subparsers())
    help_ = next(a.help for a in launch._actions if "--kv-events-replay-rate" in a.option_strings)
    assert f"default 0: {REPLAY_PER_S:g} a second" in help_
    assert launch.parse_args([]).kv_events_replay_rate == 0
    NodeConfig(node="x", kv_events_port=5000, kv_events_replay_rate=512.0).validate()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--kv-events-replay-rate"):
            NodeConfig(node="x", kv_events_port=5000, kv_events_replay_rate=bad).validate()


@pytest.mark.parametrize("spelling", [["--max_model_len", "64"], ["--max-model-len=64"], ["-tp", "1", "--max-model-len",
                                                                                           "64"]])
def test_vllms_other_spellings_are_taken(checkpoint, spelling):
    assert check_launch_argv(_plan(checkpoint, *spelling).launch_argv).max_model_len == 64


@pytest.mark.parametrize("dtype,compute", [("auto", "auto"), ("half", "float16"), ("float16", "float16"),
                                           ("bfloat16", "bfloat16"), ("float", "float32"), ("float32", "float32")])
def test_dtype_is_the_models_compute_dtype_as_in_vllm(checkpoint, dtype, compute):
    assert check_launch_argv(_plan(checkpoint, "--dtype", dtype).launch_argv).compute_dtype == compute


def test_enforce_eager_turns_the_cuda_graphs_off(checkpoint):
    assert check_launch_argv(_plan(checkpoint).launch_argv).cuda_graph_max_batch == -1  # (graphs up to --max-num-seqs)
    assert check_launch_argv(_plan(checkpoint, "--enforce-eager").launch_argv).cuda_graph_max_batch == 0


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_takes_vllms_fp8_names(checkpoint, kv):
    assert check_launch_argv(_plan(checkpoint, "--kv-cache-dtype", kv).launch_argv).kv_cache_dtype == kv


def test_kvrts_own_flags_pass_through(checkpoint):
    args = check_launch_argv(_plan(checkpoint, "--num-cpu-blocks", "64", "--eviction", "lru").launch_argv)
    assert (args.num_cpu_blocks, args.eviction) == (64, "lru")


@pytest.mark.parametrize("name", sorted({n for row in vllm_flags.TABLE if isinstance(row, vllm_flags.NoCounterpart)
                                         for n in row.names}))
def test_every_vllm_flag_without_a_counterpart_is_refused_naming_it(checkpoint, name):
    with pytest.raises(ServeError, match=f"vLLM's {name} has no counterpart in kvrt"):
        _plan(checkpoint, name, "1")


@pytest.mark.parametrize("argv,words", [
    (["--no-enable-prefix-caching"], "is a prefix cache"),
    (["--no-enable-chunked-prefill"], "always chunks"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: kvrt takes auto, fp8, fp8_e4m3"),
    (["--dtype", "int8"], "--dtype int8: kvrt takes"),
    (["--max-logprobs", "50"], "at most 20"),
    (["--scheduling-policy", "priority"], "fcfs"),
    (["--http-port", "1"], "not a kvrt serve flag"),
    (["--frobnicate"], "neither one of vLLM's flags nor a kvrt launch flag"),
])
def test_what_kvrt_does_not_do_is_refused_saying_why(checkpoint, argv, words):
    with pytest.raises(ServeError, match=words):
        _plan(checkpoint, *argv)


def test_a_hub_id_is_found_in_the_local_cache_at_its_revision(hub_cache):
    folder, commits = hub_cache
    assert _plan("Org/Tiny").model_dir == str(folder / "snapshots" / commits["main"])
    p = _plan("Org/Tiny", "--revision", "v1")
    assert p.model_dir == str(folder / "snapshots" / commits["v1"]) and p.model_id == "Org/Tiny"
    assert check_launch_argv(p.launch_argv).served_model_name == ["Org/Tiny"]


def test_a_model_in_no_cache_is_an_error_naming_the_cache(hub_cache, tmp_path):
    with pytest.raises(ServeError, match=f"not in the local Hugging Face cache {tmp_path / 'hf' / 'hub'}"):
        _plan("Org/Other")
    with pytest.raises(ServeError, match="at revision v9"):
        _plan("Org/Tiny", "--revision", "v9")
    other = tmp_path / "elsewhere"
    with pytest.raises(ServeError, match=str(other)):
        _plan("Org/Tiny", "--download-dir", str(other))


def _run(argv: list[str]) -> tuple[int, str]:
    """`kvrt ARGV` in this process, its exit code and stderr; the logging set-up the command
    makes (a rate limit on the root logger's handlers, which are pytest's here) undone after, so
    that no later test's captured logs are filtered."""
    root = logging.getLogger()
    handlers, level = [(h, list(h.filters)) for h in root.handlers], root.level
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = launcher.main(argv)
    finally:
        for h, filters in handlers:
            h.filters[:] = filters
        root.setLevel(level)
    return code, err.getvalue()


def test_kvrt_serve_refuses_before_starting_anything(hub_cache):
    code, err = _run(["serve", "Org/Missing"])
    assert code == 2 and "kvrt serve: error" in err and "Hugging Face cache" in err
    code, err = _run(["serve", "Org/Tiny", "--enable-lora"])
    assert code == 2 and "vLLM's --enable-lora has no counterpart in kvrt" in err


def test_a_launch_nobody_could_reach_is_refused():
    code, err = _run(["launch", "--node", "unreachable-test"])
    assert code == 2 and "nobody could reach this node" in err


def test_the_guide_holds_the_flag_table_as_the_table_makes_it():
    with open(os.path.join(REPO, "docs", "guide.md"), encoding="utf-8") as f:
        assert vllm_flags.markdown_table() in f.read()


def test_the_table_names_each_flag_once():
    assert len(vllm_flags.names()) > 150
