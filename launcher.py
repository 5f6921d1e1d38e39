"""kvrt: the node launcher and command-line entry point.

Each subcommand lives in the module that owns the behaviour; this file only dispatches, so
`kvrt --help` lists everything a user can do on a node.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys

from kvrt.runtime.http.reasoning import PARSERS as REASONING_PARSERS
from kvrt.runtime.http.tool_calls import PARSERS as TOOL_CALL_PARSERS

# benchmark name -> (module, one-line help); each module has main(argv) -> int
BENCHES = {
    "ipc": ("kvrt.bench.ipc", "ring vs multiprocessing.Queue, BaseManager over TCP and pyzmq ipc://"),
    "cache": ("kvrt.bench.cache", "replay a request trace through the prefix cache (hit rates, blocks/s)"),
    "copy": ("kvrt.bench.copy", "KV block swaps device<->host vs the memcpy limit, and end-to-end through cache-transfer"),
    "pd": ("kvrt.bench.pd", "P->D KV block transfer: shm and Mooncake transports vs memcpy and a raw TCP socket"),
    "replay": ("kvrt.bench.replay", "a trace against a node it launches, prefix cache on vs off (TTFT, tokens computed)"),
    "storage": ("kvrt.bench.storage", "storage tiers: Mooncake Store and file put/get vs a raw socket; cross-node TTFT with a shared store"),
    "route": ("kvrt.bench.route", "N nodes behind kvrt route: hit rate and TTFT per routing policy vs one node"),
    "model": ("kvrt.bench.model", "a (~0.5B-shaped) checkpoint's step by phase vs its roofline and vs transformers"),
    "serve": ("kvrt.bench.serve", "any OpenAI-compatible server over HTTP: TTFT/TPOT/ITL, goodput, hit rate"),
    "sampler": ("kvrt.bench.sampler", "sampling a token (temperature, top-k/p) vs the greedy argmax, a full sort and one read"),
    "throughput": ("kvrt.bench.throughput", "a node's output tokens/s on nano-vllm's offline workload (256 requests)"),
    "attacks": ("kvrt.bench.attacks", "another client's request while one client attacks a node (text work, answers, bursts)"),
    "gateway": ("kvrt.bench.gateway", "a request through the gateway process vs the engine's private socket and a pyzmq echo"),
}
DEMO_BLOCKS = (192, 1024)  # device, host blocks of `kvrt launch --demo` with default pool sizes
# the model's shape: flags for the reference model, config.json's for a checkpoint
SHAPE_FLAGS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len")
# `kvrt launch` flags named as a node config field whose field launch() works out from them
WORKED_OUT = frozenset({"node", "port", "device", "num_gpu_blocks", "dtype", "pd_secret_file", "compute_dtype",
                        "model_backend", "events_secret_file", "storage_secret_file", "layer_windows",
                        *SHAPE_FLAGS})
STRESS = {
    "ring": ("kvrt.bench.stress_ring", "multiprocess ring stress: N producers, checksums, order, SIGKILL"),
}


def _dispatch(table: dict, kind: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        lines = [f"usage: kvrt {kind} NAME [options]   (kvrt {kind} NAME --help for options)", "", "names:"]
        lines += [f"  {name:<8} {help_}" for name, (_, help_) in table.items()]
        print("\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nkvrt {kind}: unknown name {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module, _ = table[argv[0]]
    return importlib.import_module(module).main(argv[1:])


def _detect_device() -> str:
    """cuda when CuPy is installed and sees a GPU, else cpu."""
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # not installed, no driver, no device: all mean "use the CPU"
        return "cpu"


def _threads(value: str) -> int:
    """--threads: a positive count, or auto (0)."""
    if value == "auto":
        return 0
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {value!r}")
    return n


def _add_launch(sub) -> argparse.ArgumentParser:
    from kvrt.runtime.cache.policies.base import policy_names
    # the HTTP bridge's ENGINE_TIMEOUT_S is LIVENESS_S (tests/test_cli.py holds the two together):
    # named here from the client API, every kvrt command builds this parser without loading the
    # HTTP stack (the client, its templates, asyncio), which a node without --http-port never uses
    from kvrt.runtime.client.api import LIVENESS_S as ENGINE_TIMEOUT_S
    from kvrt.runtime.client.api import PROBE_S
    from kvrt.runtime.node.config import NodeConfig

    d = NodeConfig(node="")
    p = sub.add_parser("launch", help="start a node (engine, workers, cache-transfer/messager processes); --demo runs the demo",
                       description="Start one kvrt node and supervise it until SIGINT/SIGTERM. Creates every "
                       "shared-memory object of the node, starts its processes, waits until each is ready, and "
                       "stops the node cleanly (exit 1) if any process dies.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read options from a TOML file (YAML if FILE ends in .yaml/.yml and PyYAML is installed): "
                   "keys are the long flag names, with - or _ (num-gpu-blocks = 256); flags given on the command "
                   "line override the file; an unknown key or a value of the wrong type is an error naming the key")
    p.add_argument("--node", default="", help="node name, unique on this machine (default: kvrt<port> or kvrt<pid>)")
    p.add_argument("--role", default=d.role, choices=["mixed", "prefill", "decode"],
                   help="mixed (default): prefill and decode here; prefill: compute prompts and hand their KV "
                   "to --decode-peer; decode: continue requests a prefill node handed over")
    p.add_argument("--decode-peer", default="", metavar="tcp://HOST:PORT[,...]",
                   help="prefill role: the decode node's client API address (its --host/--port), or several "
                   "comma-separated: each request goes to the one with the most free blocks, and to the "
                   "next when one refuses it or is lost")
    p.add_argument("--pd-transport", default=d.pd_transport, choices=["shm", "mooncake"],
                   help="how KV blocks travel P->D: shm (same machine) or mooncake (TCP/RDMA, any machines); "
                   "both nodes must use the same (default shm)")
    p.add_argument("--pd-timeout", type=float, default=d.pd_timeout,
                   help=f"seconds P waits for D's blocks and D holds blocks for P's KV (default {d.pd_timeout:g})")
    p.add_argument("--pd-dead-after", type=float, default=d.pd_dead_after, metavar="S",
                   help=f"prefill role: a decode node that answers nothing (P pings each every 0.5 s) for this long "
                   f"is gone: its requests not yet allocated go to another, and with none left P fails requests "
                   f"at once (default {d.pd_dead_after:g}; at most --pd-timeout)")
    p.add_argument("--pd-secret-file", default="", metavar="PATH",
                   help="prefill/decode roles: file holding the secret both nodes share (at least 16 bytes, "
                   "mode 0600; default: $KVRT_PD_SECRET). Make one with: python -c 'import secrets; "
                   "print(secrets.token_hex(32))' > pd.secret && chmod 600 pd.secret")
    p.add_argument("--pd-peer-max-blocks", type=int, default=d.pd_peer_max_blocks,
                   help="decode role: device blocks one prefill peer may ever hold at once; within it each peer "
                   "gets a max-min fair share of the pool, and a request over its share waits (default: the pool)")
    p.add_argument("--pd-peer-max-preallocs", type=int, default=d.pd_peer_max_preallocs,
                   help=f"decode role: preallocations one prefill peer may have waiting for its KV; more wait in "
                   f"D's queue (default {d.pd_peer_max_preallocs})")
    p.add_argument("--tp", type=int, default=d.tp,
                   help="tensor-parallel ranks (default 1). With --model each rank holds 1/N of the heads, KV "
                   "heads and MLP, and an all-reduce over shared memory sums their outputs (same tokens as "
                   "--tp 1). The reference model is not split: each rank runs it over its share of the KV "
                   "heads and rank 0's tokens are the answer, so its outputs depend on --tp")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the device KV pool lives (default: cuda if CuPy sees a GPU, else cpu)")
    p.add_argument("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help=f"device blocks per rank (default: on a GPU, what --gpu-memory-utilization of its free "
                   f"memory holds; on a CPU {d.num_gpu_blocks}); on a GPU checked against its free memory")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization, metavar="F",
                   help=f"share of each GPU's free memory the default device pool takes, in (0, 1] "
                   f"(default {d.gpu_memory_utilization:g})")
    p.add_argument("--num-cpu-blocks", type=int, default=d.num_cpu_blocks,
                   help="host (swap) blocks per rank; > 0 starts cache-transfer processes (default 0)")
    p.add_argument("--storage", default="", help="storage tier: file:DIR[?max_bytes=N] (node-local, capped, LRU-evicted) or "
                   "mooncake://HOST:PORT (a Mooncake Store shared by every node on that master; see kvrt store start) "
                   "(default: none)")
    p.add_argument("--storage-secret-file", default="", metavar="PATH",
                   help="file holding the secret the nodes of a storage tier share (at least 16 bytes, mode 0600): "
                   "every block written carries a MAC keyed by it, and a block read without a valid one is a miss "
                   "(counted in storage_forged), never served. Needed for mooncake:// unless --storage-insecure; "
                   "optional for file: (default: none)")
    p.add_argument("--storage-insecure", action="store_true",
                   help="use a mooncake:// store without --storage-secret-file: its blocks, which anyone who "
                   "reaches the store can write, are served unchecked")
    p.add_argument("--eviction", choices=policy_names(), default=d.eviction,
                   help=f"prefix cache eviction policy, both tiers (default {d.eviction}: gaps' order, its bonus "
                   f"steered by what a sampled shadow LRU would have served, runtime/cache/policies/adaptive.py; "
                   f"gaps: by age, with a bonus for blocks reused before whose reuse came back within the "
                   f"cache's reach, runtime/cache/policies/gaps.py; reuse: by age and reuse count, runtime/cache/policies/reuse.py; "
                   f"lru: least recently used)")
    p.add_argument("--host", default=d.host, help=f"interface the client API listens on (default {d.host})")
    p.add_argument("--port", type=int, default=d.port,
                   help="client API port (ZeroMQ; used by kvrt generate/replay and runtime.client.client; 0 = none)")
    p.add_argument("--http-port", type=int, default=0, metavar="H",
                   help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/tokenize, /detokenize, /version, /health, /metrics) on --host:H; needs --port (0 = off)")
    p.add_argument("--http-host", default=None, metavar="HOST",
                   help="interface the HTTP API listens on (default: --host); kvrt serve keeps --host on loopback "
                   "and gives its --host here, so that only the HTTP port faces clients")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="every HTTP route but GET /health answers 401 unless the request carries `Authorization: Bearer KEY`, as "
                   "vLLM's --api-key (the ZeroMQ client API has no key: keep --host on loopback)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the HTTP API's chat template instead of the tokenizer's, as vLLM's flag: a file, or the "
                   "Jinja template itself")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="HTTP requests without a seed draw theirs from a generator seeded with N, in arrival "
                   "order, as vLLM's --seed (default: each draws a fresh random seed)")
    p.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="the host tier in GiB per rank, as vLLM's flag: --num-cpu-blocks becomes what GIB holds "
                   "(one or the other)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per HTTP request: client, method, path, status, time (kvrt serve: on unless "
                   "--disable-uvicorn-access-log)")
    p.add_argument("--log-requests", action="store_true",
                   help="log each HTTP request's parameters as it arrives (never its prompt's text), as vLLM's "
                   "--enable-log-requests")
    p.add_argument("--log-stats-interval", type=float, default=0.0, metavar="S",
                   help="log a stats line every S seconds: prompt and generation throughput, requests running "
                   "and waiting, KV usage per tier, prefix cache hit rate per tier (0 = off; kvrt serve: 10 "
                   "unless --disable-log-stats)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's own log level, as vLLM's flag (default warning)")
    p.add_argument("--http-engine-timeout", type=float, default=ENGINE_TIMEOUT_S, metavar="S",
                   help=f"the HTTP server fails (504) every request in flight when the engine sends nothing at all "
                        f"(not even its liveness probes, every {PROBE_S:g} s, steps or no steps) for S seconds: it is "
                        f"stopped, hung or unreachable (default {ENGINE_TIMEOUT_S:g})")
    p.add_argument("--http-stall-timeout", type=float, default=None, metavar="S",
                   help="the HTTP server drops the connection of an answer (streamed, or large) whose write waited "
                        "S seconds for a client that reads nothing, and cancels its requests (default 10 s, "
                        "runtime/http/stalled.py STALL_S)")
    p.add_argument("--http-idle-timeout", type=float, default=None, metavar="S",
                   help="the HTTP server closes a connection that sends nothing for S seconds (none of a request "
                        "yet, or none since its last answer) (default 5 s, runtime/http/connections.py IDLE_S)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids of the HTTP API, as vLLM's: requests may name any of them, /v1/models "
                   "reports the first (default: --model exactly as given, or kvrt-reference)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how the HTTP API reads tool calls in chat answers, as vLLM's flag: hermes (<tool_call> "
                   "JSON, Qwen2.5/Qwen3) or llama3_json (Llama 3.1+) (default: the format the chat template names)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a thinking model's <think>...</think> into the HTTP API's reasoning_content, as "
                   "vLLM's flag (default: off)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus metrics port on 127.0.0.1 (0 = off)")
    p.add_argument("--kv-events-port", type=int, default=d.kv_events_port, metavar="P",
                   help="publish the prefix cache's KV events (vLLM's shape: block stored / removed / all cleared, per "
                        "tier) on a ZeroMQ PUB socket on --host:P, with replay and snapshots on P+1 (0 = off)")
    p.add_argument("--kv-events-replay-rate", type=float, default=d.kv_events_replay_rate, metavar="R",
                   help="replay answers the engine gives a second on the KV events' replay port, in bursts of up to "
                        "16 between two steps (default 0: 64 a second, runtime/cache/events.py REPLAY_PER_S)")
    p.add_argument("--events-secret-file", default="", metavar="PATH",
                   help="the KV events' deployment secret (at least 16 bytes, mode 0600; the same file for every "
                        "node and kvrt route): only subscribers holding it are admitted (ZeroMQ CURVE) and the "
                        "published block keys are hashed with it; required when --host is not loopback")
    p.add_argument("--log-dir", default="", help="write each process's log to DIR/<role>-<rank>.log (default: stderr)")
    p.add_argument("--model", default="", metavar="DIR",
                   help="serve a Hugging Face checkpoint directory (config.json + safetensors; Llama, Qwen2, "
                   "Qwen3) instead of the built-in reference model; the shape flags below then come from its "
                   "config.json, and one that contradicts it is an error")
    p.add_argument("--num-layers", type=int, default=None, help=f"model layers (default {d.num_layers})")
    p.add_argument("--num-kv-heads", type=int, default=None, help=f"KV heads, split over --tp (default {d.num_kv_heads})")
    p.add_argument("--head-dim", type=int, default=None, help=f"head dimension (default {d.head_dim})")
    p.add_argument("--dtype", default=None,
                   help=f"KV dtype (default: float16 when --compute-dtype resolves to float16, else {d.dtype})")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "fp8", "fp8_e4m3"],
                   help="what the KV blocks hold, as vLLM's flag: auto (default) is --dtype; fp8 and fp8_e4m3 are "
                   "FP8 e4m3 with a per-layer scale of 1 (half a float16 block: twice the blocks on every tier in "
                   "the same memory); their block keys differ from --dtype's, so no tier or peer mixes the two")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="what a --model checkpoint's projections multiply in (default auto: float32 on a CPU, the "
                   "checkpoint's own F16/BF16 precision on a GPU). float16 holds the weights in half the bytes and "
                   "accumulates in float32 (norms, attention, softmax, residual stream and logits stay float32); "
                   "bfloat16 is computed as float16 (CuPy has no bfloat16; BF16 weights convert exactly where they "
                   "fit, and a weight beyond float16's range is refused; the torch backend computes it as bfloat16). The "
                   "reference model computes in float64"),
    p.add_argument("--model-backend", default="auto", choices=["auto", "array", "torch"],
                   help="how a --model checkpoint runs (default auto: torch on a GPU where torch and Triton import, "
                   "else array). array: the NumPy/CuPy path; torch: torch's GEMMs, fused Triton kernels with paged "
                   "attention read in place (plain torch on a CPU), and on a GPU decode steps replayed as CUDA graphs")
    p.add_argument("--cuda-graph-max-batch", type=int, default=d.cuda_graph_max_batch, metavar="N",
                   help="torch backend on a GPU, --tp 1: capture decode steps as CUDA graphs at start-up for batches "
                   "of up to N sequences, in buckets 1, 2, 4, 8, 16, 32, 48, ...; larger batches, prefill and mixed "
                   "steps run eager (default: --max-num-seqs; 0: no graphs)"),
    p.add_argument("--threads", type=_threads, default=os.environ.get("KVRT_THREADS", "auto"),
                   metavar="N|auto",
                   help="BLAS threads of each worker's matmuls on a CPU (default: $KVRT_THREADS, else auto: one "
                   "thread for a step of fewer than 64 token rows, such as a decode step, where threads that wait "
                   "for each other cost more than they share, and for larger steps, such as a prefill chunk, the cores "
                   "of the worker's share (its CPUs / --tp) that other processes are not running on as the step "
                   "starts, at least one); N fixes N threads for every step")
    p.add_argument("--vocab-size", type=int, default=None, help=f"model vocabulary (default {d.vocab_size})")
    p.add_argument("--layer-windows", type=_windows, default=None, metavar="W,W,...",
                   help="each layer's attention window in tokens, 0 for full attention (default: every layer full; "
                   "with --model from its config.json, which this must agree with): layers that attend alike "
                   "form groups with block tables of their own in the one KV pool, and a sliding group's "
                   "blocks are freed once they leave its window")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"longest prompt + output in tokens (default {d.max_model_len}; with --model its "
                   f"max_position_embeddings, which it may only lower)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"sequences per step (default {d.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help=f"tokens per step: prefill chunks + decodes (default {d.max_num_batched_tokens})")
    p.add_argument("--demo", action="store_true",
                   help="run the built-in demo: a multi-turn workload with shared system prompts through this "
                   "node, a results table, a status snapshot, then a clean stop (picks a free --port if none; "
                   "with the default pool sizes it uses %d device + %d host blocks so swaps show; child logs "
                   "at WARNING unless -v)" % DEMO_BLOCKS)
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout, help="seconds to wait for every process to be ready")
    p.add_argument("--rank-timeout", type=float, default=d.rank_timeout, help="seconds to wait for a rank's answer to a task")
    p.add_argument("--grammar-workers", type=int, default=d.grammar_workers,
                   help=f"guided decoding's compile processes: up to this many clients' grammars compile at once "
                   f"(default {d.grammar_workers})")
    p.add_argument("--grammar-timeout", type=float, default=d.grammar_timeout,
                   help=f"seconds one grammar may take to compile; past it the compile process is killed and the "
                   f"request refused with a 400 naming this limit (default {d.grammar_timeout:g})")
    p.add_argument("--grammar-memory-mib", type=int, default=d.grammar_memory_mib,
                   help=f"MiB of memory one grammar's compile may take; past it the compile fails and the request "
                   f"is refused with a 400 naming this limit (default {d.grammar_memory_mib})")
    p.add_argument("--wait-spin-us", type=int, default=d.wait_spin_us, metavar="US",
                   help="microseconds the engine's and each cache-transfer's waits spin (and a swap's wait polls its "
                   "copy's CUDA event) before they sleep (default: 250 on a GPU node, whose cores are to spare, so "
                   "a one-block swap's answer is met spinning; 0 on a CPU node)")
    p.add_argument("--hang-timeout", type=float, default=d.hang_timeout,
                   help=f"seconds without a heartbeat after which a ready process counts as hung and the node "
                   f"stops with exit 1, as for a dead one (default {d.hang_timeout:g}; start-up is bounded by "
                   f"--ready-timeout instead); counted in the launcher's own running time, so a node paused "
                   f"whole (VM pause, docker pause) and resumed is not hung")
    p.add_argument("--launcher-grace", type=float, default=d.launcher_grace, metavar="S",
                   help=f"the least seconds the launcher's heartbeat may stand still before the engine calls it "
                   f"stopped or hung, fails the requests in flight and stops the node (the larger of this and "
                   f"twice --hang-timeout; default {d.launcher_grace:g}: the launcher's loop shares its process "
                   f"with the HTTP server)")
    return p


def launch(args) -> int:
    from kvrt.ipc import sockets
    from kvrt.ipc.errors import IpcError, NodeLive
    from kvrt.ipc.ports import free_port
    from kvrt.runtime.node.config import ConfigError, NodeConfig
    from kvrt.runtime.node.supervisor import Node
    from kvrt.workers import kv_pool

    # the client API port: the one given, or (for the demo and the HTTP server, which talk through
    # it) one picked free
    port = args.port or (free_port(args.host) if args.demo or args.http_port else 0)
    d = NodeConfig(node="")
    if args.demo and args.num_gpu_blocks is None and args.num_cpu_blocks == d.num_cpu_blocks:
        args.num_gpu_blocks, args.num_cpu_blocks = DEMO_BLOCKS  # small enough that the host tier works too
    node = args.node or (f"kvrt{port}" if port else f"kvrt{os.getpid()}")
    gpu_blocks = d.num_gpu_blocks if args.num_gpu_blocks is None else args.num_gpu_blocks  # on a GPU: below
    device = _detect_device() if args.device == "auto" else args.device
    try:
        shape, model = _model_settings(args, d, device)
    except ValueError as e:  # the checkpoint cannot be served, or a flag contradicts it
        print(f"kvrt launch: error: {e}", file=sys.stderr)
        return 2
    # the KV pools hold what the model computes unless --dtype says otherwise
    kv_dtype = args.dtype or ("float16" if model.get("compute_dtype") in ("float16", "bfloat16") else d.dtype)
    fields = {f.name for f in dataclasses.fields(NodeConfig)}
    # a flag named as a config field is that field, as it is; the others were worked out above
    same = {k: v for k, v in vars(args).items() if k in fields and k not in WORKED_OUT}
    cfg = NodeConfig(**same, node=node, port=port, device=device, num_gpu_blocks=gpu_blocks, dtype=kv_dtype,
                     pd_secret_file=os.path.abspath(args.pd_secret_file) if args.pd_secret_file else "",
                     events_secret_file=os.path.abspath(args.events_secret_file) if args.events_secret_file else "",
                     storage_secret_file=os.path.abspath(args.storage_secret_file) if args.storage_secret_file else "",
                     check_ownership=os.environ.get("KVRT_CHECK_OWNERSHIP", "") == "1", **shape, **model)
    try:
        if args.swap_space is not None:
            cfg.num_cpu_blocks = _swap_space_blocks(args.swap_space, args.num_cpu_blocks != d.num_cpu_blocks,
                                                    cfg.block_bytes)
        cfg.validate()
    except ConfigError as e:
        print(f"kvrt launch: error: {e}", file=sys.stderr)
        return 2
    if cfg.device == "cuda":
        try:
            cfg.num_gpu_blocks = kv_pool.plan_gpu_blocks(args.num_gpu_blocks, cfg.gpu_memory_utilization,
                                                         cfg.block_bytes, cfg.tp, kv_pool.cuda_free_bytes())
        except RuntimeError as e:  # not enough free device memory, or no usable CUDA
            print(f"kvrt launch: error: {e}", file=sys.stderr)
            return 1
    if args.http_port and not 0 < args.http_port <= 65535:
        print(f"kvrt launch: error: --http-port must be 1..65535, got {args.http_port}", file=sys.stderr)
        return 2
    if not args.http_engine_timeout > 0:
        print(f"kvrt launch: error: --http-engine-timeout must be > 0, got {args.http_engine_timeout}", file=sys.stderr)
        return 2
    if not (args.port or args.http_port or args.demo):
        print("kvrt launch: error: nobody could reach this node: give --port P (the ZeroMQ client API) and/or "
              "--http-port H (the OpenAI-compatible HTTP API; or kvrt serve MODEL, which serves HTTP on 8000)",
              file=sys.stderr)
        return 2
    if args.log_stats_interval < 0:
        print(f"kvrt launch: error: --log-stats-interval must be >= 0, got {args.log_stats_interval}", file=sys.stderr)
        return 2
    job = None
    if args.demo:
        from kvrt.runtime.client.demo import demo_job

        job = demo_job(cfg)
    http = None
    ready_line = ""
    if args.http_port:
        from kvrt.runtime.http.server import HttpOptions, HttpServer, cache_info, served_model_names

        names = served_model_names(args.served_model_name, args.model)
        http_host = args.http_host or args.host
        try:
            options = HttpOptions.of(args)
            # the engine's private socket (ipc/sockets.py): no gateway between them, so the HTTP
            # API serves on while a gateway that libzmq aborted is being replaced
            engine = sockets.address(cfg.node, sockets.API)
            http = HttpServer(http_host, args.http_port, args.host, engine, names, cfg.node, args.metrics_port,
                              cache_info(cfg), args.tool_call_parser, args.reasoning_parser,
                              engine_timeout=args.http_engine_timeout, options=options)
        except ValueError as e:  # the chat template cannot be read, or TMPDIR is too long for the engine's socket
            print(f"kvrt launch: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"kvrt launch: error: {e}", file=sys.stderr)
            return 1
        ready_line = f"serving {names[0]!r} at {http.url()}/v1 (OpenAI-compatible HTTP API)"
        http.start()
    stats = None
    if args.log_stats_interval > 0:
        from kvrt.runtime.node.stats_log import StatsLog

        stats = StatsLog(cfg.node, args.log_stats_interval)
        stats.start()

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if ready_line and message.startswith(f"node {cfg.node} ready"):
            print(ready_line, file=sys.stderr, flush=True)

    try:
        return Node(cfg, kv_pool.PoolMaker(), progress=progress).run(job)
    except NodeLive as e:
        print(f"kvrt launch: error: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, OSError, IpcError) as e:
        print(f"kvrt launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        if stats is not None:
            stats.stop()
        if http is not None:
            http.stop()


def _swap_space_blocks(gib: float, blocks_given: bool, block_bytes: int) -> int:
    """--swap-space GIB as host blocks per rank (vLLM's flag for kvrt's host tier)."""
    import math

    from kvrt.runtime.node.config import ConfigError

    if blocks_given:
        raise ConfigError("--swap-space and --num-cpu-blocks both size the host tier: give one")
    if not (math.isfinite(gib) and gib >= 0):
        raise ConfigError(f"--swap-space must be a number of GiB >= 0, got {gib}")
    return int(gib * 2**30 // block_bytes)


def _serve(launch_parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """`kvrt serve`: vLLM's command line translated to `kvrt launch`'s (runtime/node/serve.py),
    then launched in this process (an API key in it stays out of any process list)."""
    from kvrt.runtime.node.serve import ServeError, parser, plan

    if any(a in ("-h", "--help") for a in argv):
        parser().parse_args(["--help"])  # prints the help and exits 0, as every command's --help
    try:
        served = plan(argv, {s for a in launch_parser._actions for s in a.option_strings})
    except ServeError as e:
        print(f"kvrt serve: error: {e}", file=sys.stderr)
        return 2
    return launch(launch_parser.parse_args(served.launch_argv))


def _model_settings(args: argparse.Namespace, d, device: str) -> tuple[dict, dict]:
    """The shape fields of the node config and the model fields: from the flags (or their
    defaults) for the reference model; from config.json for a checkpoint, checked end to end
    (headers, every tensor) here, before any process starts, with the compute dtype resolved
    for `device`. ValueError names what is wrong."""
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if not args.model:
        if args.compute_dtype != "auto":
            raise ValueError(f"--compute-dtype {args.compute_dtype} is for --model checkpoints: the built-in "
                             f"reference model computes in float64 (its exactness is what the tests check)")
        if args.model_backend == "torch":
            raise ValueError("--model-backend torch is for --model checkpoints: the built-in reference model "
                             "computes in float64 on NumPy")
        shape = {k: given.get(k, getattr(d, k)) for k in SHAPE_FLAGS}
        shape["layer_windows"] = args.layer_windows or []
        return shape, {}
    from kvrt.workers.model.backends import resolve_backend
    from kvrt.workers.model.checkpoint import inspect
    from kvrt.workers.model.hf_model import resolve_compute_dtype

    info = inspect(args.model)
    info.check_tp(args.tp)
    shape = info.node_shape()
    for k, v in given.items():
        flag = "--" + k.replace("_", "-")
        if k == "max_model_len":
            if v > shape[k]:
                raise ValueError(f"{flag} {v} exceeds {shape[k]}, the checkpoint's limit set by "
                                 f"{info.config.max_model_len()[1]}")
            shape[k] = v
        elif v != shape[k]:
            raise ValueError(f"{flag} {v} contradicts {info.model_dir}/config.json, which gives {shape[k]}")
    shape["layer_windows"] = list(info.config.layer_windows(shape["max_model_len"]))
    if args.layer_windows is not None and args.layer_windows != (shape["layer_windows"] or [0] * shape["num_layers"]):
        raise ValueError(f"--layer-windows {args.layer_windows} contradicts {info.model_dir}/config.json, which gives "
                         f"{shape['layer_windows'] or 'full attention in every layer'}")
    backend = resolve_backend(args.model_backend, device, info.config, args.kv_cache_dtype)
    return shape, {"model_dir": info.model_dir, "model_arch": info.config.arch,
                   "model_fingerprint": info.fingerprint, "hidden_size": info.config.hidden_size,
                   "compute_dtype": resolve_compute_dtype(args.compute_dtype, device, info, backend),
                   "model_backend": backend}


def _windows(text: str) -> list[int]:
    """--layer-windows: comma-separated window sizes >= 0 (argparse type)."""
    try:
        out = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if min(out) < 0:
        raise argparse.ArgumentTypeError(f"windows must be >= 0 tokens, got {text}")
    return out


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0 (argparse type): refused at parsing, not mid-run."""
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    """The kvrt command. A reader that goes away (`kvrt status --watch 1 | head -3`) ends it
    with exit 1 and no traceback, as for any command whose output was cut short."""
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # stdout is gone: point it at /dev/null so the interpreter's last flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvrt",
        description="kvrt: a shared-memory KV-cache runtime for LLM serving nodes.",
        epilog="Run `kvrt COMMAND --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch_parser = _add_launch(sub)
    sub.add_parser("serve", help="serve a model over HTTP with vllm serve's command line (kvrt serve MODEL "
                   "[vLLM flags]): a hub id or directory, port 8000", add_help=False)
    st = sub.add_parser("status", help="inspect live nodes from their shared memory (read-only)")
    st.add_argument("--node", help="node name (default: every node found)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", type=_seconds, default=0.0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    cl = sub.add_parser("clean", help="reclaim the shared memory of dead nodes (refuses live ones)")
    cl.add_argument("--node", help="node name (default: every dead node found)")
    cl.add_argument("--dry-run", action="store_true", help="list what would be removed")
    sub.add_parser("generate", help="send one request to a running node and stream its tokens", add_help=False)
    sub.add_parser("replay", help="replay a request trace against a running node (TTFT, hit rates)", add_help=False)
    sub.add_parser("route", help="an OpenAI-compatible HTTP router in front of nodes (cache-aware)", add_help=False)
    sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False)
    sub.add_parser("stress", help="stress tests: " + ", ".join(STRESS), add_help=False)
    sub.add_parser("store", help="kvrt store start: a Mooncake Store master for --storage mooncake://", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "launch" and args.config:
        from kvrt.runtime.node.config_file import ConfigFileError, config_defaults

        try:
            launch_parser.set_defaults(**config_defaults(launch_parser, args.config))
        except ConfigFileError as e:
            launch_parser.error(f"--config {e}")
    if args.command in ("launch", "status", "clean"):
        args = parser.parse_args(argv)
    if args.command in ("status", "clean") and args.node is not None:
        from kvrt.ipc.shm import validate_node_name

        try:
            validate_node_name(args.node)
        except ValueError as e:
            (st if args.command == "status" else cl).error(f"--node: {e}")
    quiet = args.command == "launch" and args.demo and not args.verbose
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvrt.ipc.log_limit import limit_logs

    limit_logs()  # a flood of bad input is not a flood of log lines (the HTTP server's and the router's)
    if args.command == "launch":
        return launch(args)
    if args.command == "serve":
        return _serve(launch_parser, rest)
    if args.command == "status":
        from kvrt.runtime.node.status import status_main

        try:
            return status_main(args.node, args.json, args.watch)
        except KeyboardInterrupt:
            return 0
    if args.command == "clean":
        from kvrt.runtime.node.status import clean_main

        return clean_main(args.node, args.dry_run)
    if args.command == "generate":
        from kvrt.runtime.client.client import generate_main

        return generate_main(rest)
    if args.command == "replay":
        from kvrt.runtime.client.replay import main as replay_main

        return replay_main(rest)
    if args.command == "route":
        from kvrt.runtime.router.main import main as route_main

        return route_main(rest)
    if args.command == "bench":
        return _dispatch(BENCHES, "bench", rest)
    if args.command == "stress":
        return _dispatch(STRESS, "stress", rest)
    if args.command == "store":
        from kvrt.workers.storage.mooncake import store_main

        return store_main(rest)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
