"""`kvrt serve MODEL [flags]`: vLLM's serving command, as a `kvrt launch` command line.

Why a translation and not a second launcher: `kvrt launch` is the one place a node is checked and
started, so `kvrt serve` only says what vLLM's flags mean in kvrt (runtime/node/vllm_flags.py, one
table) and adds what `vllm serve` does without being asked: the model looked up in the local
Hugging Face cache (runtime/node/hub.py), HTTP on port 8000, the node's internal ZeroMQ port
picked free on loopback (only the HTTP port faces clients), the model id as given, a stats line
every 10 s and an access log. Every `kvrt launch` flag that vLLM has no name for (`--num-cpu-blocks`,
`--storage`, `--kv-events-port`, ...) may follow as it is.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

from kvrt.runtime.node import vllm_flags
from kvrt.runtime.node.hub import ModelNotFound, resolve_model

LOOPBACK = "127.0.0.1"
# `kvrt launch` flags that `kvrt serve` sets itself from vLLM's (or that make no sense for it)
NOT_PASSED = frozenset({"--http-port", "--http-host", "--model", "--demo", "--port", "--config", "--help", "-h"})
API_KEY_ENV = "VLLM_API_KEY"


class ServeError(ValueError):
    """`kvrt serve`'s command line cannot start a node; the message says which flag and why."""


@dataclass
class ServePlan:
    """The `kvrt launch` command line of a `kvrt serve` one, and what its ready line says."""

    launch_argv: list[str]
    model_id: str
    model_dir: str


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrt serve", description="Serve a model over the OpenAI-compatible HTTP API with vllm serve's "
        "command line: MODEL is a checkpoint directory or a hub id in the local Hugging Face cache. vLLM's flags "
        "that kvrt has a counterpart for are below; any other vLLM flag is refused, naming it. Every kvrt "
        "launch flag vLLM has no name for (--num-cpu-blocks, --storage, --kv-events-port, ...) may follow too.",
        allow_abbrev=False)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a checkpoint directory, or a hub id (OWNER/NAME) in the local Hugging Face cache")
    vllm_flags.add_to(p)
    return p


def value_of(ns: argparse.Namespace, flag: str):
    """The value `ns` holds for the table row of vLLM's `flag` (None: not given)."""
    for i, row in enumerate(vllm_flags.TABLE):
        if flag in row.names:
            return getattr(ns, f"vllm_{i}", None)
    raise KeyError(flag)


def plan(argv: list[str], launch_flags: Iterable[str], environ: Mapping[str, str] | None = None,
         internal_port: int | None = None) -> ServePlan:
    """The `kvrt launch` argv of `kvrt serve argv`. `launch_flags`: the option strings `kvrt
    launch` has (kvrt's own flags pass through). ServeError names what is refused."""
    environ = os.environ if environ is None else environ
    argv = [vllm_flags.normalize(a) for a in argv]
    if refusal := vllm_flags.first_without_counterpart(argv):
        raise ServeError(refusal)
    ns, rest = parser().parse_known_args(argv)
    passed = _kvrt_flags(rest, set(launch_flags))
    given = value_of(ns, "--model")
    if ns.model and given and ns.model != given:
        raise ServeError(f"the model is given twice: {ns.model} and --model {given}")
    model = ns.model or given
    if not model:
        raise ServeError("give the model: kvrt serve MODEL (a checkpoint directory or a hub id such as "
                         "Qwen/Qwen3-0.6B in the local Hugging Face cache)")
    translation = vllm_flags.translate(ns)
    if translation.refusal:
        raise ServeError(translation.refusal)
    try:
        directory = resolve_model(model, value_of(ns, "--revision"), value_of(ns, "--download-dir"))
    except ModelNotFound as e:
        raise ServeError(str(e)) from None
    if internal_port is None:
        from kvrt.ipc.ports import free_port

        internal_port = free_port(LOOPBACK)
    names = value_of(ns, "--served-model-name") or [model]
    out = ["--model", directory, "--host", LOOPBACK, "--port", str(internal_port),
           "--http-host", LOOPBACK, "--http-port", str(vllm_flags.DEFAULT_HTTP_PORT),
           "--served-model-name", *names, "--access-log",
           "--log-stats-interval", f"{vllm_flags.DEFAULT_STATS_INTERVAL_S:g}"]
    if value_of(ns, "--api-key") is None and environ.get(API_KEY_ENV):
        out += ["--api-key", environ[API_KEY_ENV]]
    return ServePlan(out + translation.launch + passed, names[0], directory)


def _kvrt_flags(rest: list[str], launch_flags: set[str]) -> list[str]:
    """The `kvrt launch` flags (with their values) among what vLLM's table did not take; an
    option that is neither vLLM's nor kvrt's, or one `kvrt serve` sets itself, is refused."""
    for arg in rest:
        if not arg.startswith("-") or arg == "-" or _is_number(arg):
            continue
        name = arg.split("=", 1)[0]
        if name in NOT_PASSED:
            raise ServeError(f"{name} is not a kvrt serve flag (kvrt serve sets it: use --port and --host for "
                             f"the HTTP server)")
        if name not in launch_flags:
            raise ServeError(f"unrecognized flag {name}: neither one of vLLM's flags nor a kvrt launch flag "
                             f"(kvrt serve --help)")
    stray = [a for a in rest[:1] if not a.startswith("-")]
    if stray:
        raise ServeError(f"unexpected argument {stray[0]!r} (the model goes first: kvrt serve MODEL [flags])")
    return list(rest)


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True
