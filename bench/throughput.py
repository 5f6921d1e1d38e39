"""`kvrt bench throughput`: offline throughput of a real node on nano-vllm's published workload.

The workload, drawn as that benchmark draws it (Python's `random` seeded with 0, in its order):
256 requests, each a prompt of uniform(100, 1,024) random token ids below 10,000 and an output
of uniform(100, 1,024) tokens, the end-of-sequence token ignored, sampled at temperature 0.6.
All are submitted at once to a node this command launches (`kvrt launch --model DIR`, on
--device, its decode steps captured as CUDA graphs on a GPU) and the clock runs from the first
submission to the last answer: output tokens per second is the figure, with the prompt tokens
per second, the engine's steps and the mean tokens a step computed beside it.

Without --model, a checkpoint of Qwen3-0.6B's shapes with random weights is written first by
transformers' own `save_pretrained` (`--shape small`: a toy of the same architecture, with a
scaled-down workload, for a dry run on a CPU). The node's pool takes --gpu-memory-utilization
of the free device memory; --max-num-seqs and --max-num-batched-tokens are the scheduler's.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

log = logging.getLogger("kvrt.bench.throughput")

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=10240, max_position_embeddings=4096,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
PROMPT_VOCAB = 10000  # prompt token ids are drawn below this, as the workload draws them
TEMPERATURE = 0.6


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]


def workload(requests: int, min_len: int, max_input: int, max_output: int, seed: int = 0) -> Workload:
    """The requests in the workload's own draw order: every prompt first, then every output
    length (each from one `random.Random(seed)`)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, PROMPT_VOCAB) for _ in range(rng.randint(min_len, max_input))] for _ in range(requests)]
    outputs = [rng.randint(min_len, max_output) for _ in range(requests)]
    return Workload(prompts, outputs)


def write_checkpoint(directory: str, shape: str, seed: int = 0) -> None:
    """A Qwen3 checkpoint of `shape` with random weights, in BF16, written by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPES[shape], architectures=["Qwen3ForCausalLM"])
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


@dataclass
class Outcome:
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tokens_s: float
    prompt_tokens_s: float
    steps: int
    tokens_per_step: float
    preemptions: int
    failed: int
    unanswered: int  # still running at --timeout: the figures are then over the answered requests
    startup_s: float


def run(port: int, load: Workload, timeout: float) -> tuple[int, int, int, int, float, int]:
    """Submit every request at once and wait for all, or until `timeout` seconds: (prompt
    tokens, output tokens, preemptions, failed requests, seconds from the first submission to
    the last answer or the timeout, requests still unanswered then)."""
    from kvrt.runtime.client.api import ErrorEvent
    from kvrt.runtime.client.client import Client, Result, Sampling

    with Client(port) as client:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(load.prompts, load.outputs)):
            client.submit(prompt, n, stream=False, sampling=Sampling(temperature=TEMPERATURE, seed=i))
        left, out, preempt, failed = len(load.prompts), 0, 0, 0
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for ev in client.poll(1.0):
                if isinstance(ev, Result):
                    out += ev.num_output_tokens
                    preempt += ev.preemptions
                    left -= 1
                elif isinstance(ev, ErrorEvent):
                    log.error("request %s failed: %s", ev.request_id, ev)
                    failed += 1
                    left -= 1
        seconds = time.perf_counter() - t0
    return sum(map(len, load.prompts)), out, preempt, failed, seconds, left


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory (default: a random Qwen3 checkpoint of --shape, written "
                                   "by transformers into a temporary directory)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="without --model (default qwen3-0.6b)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="the node's device (default cuda)")
    p.add_argument("--requests", type=int, default=256, help="requests (default 256)")
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (default 100)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest prompt (default 1024)")
    p.add_argument("--max-output-len", type=int, default=1024, help="longest output (default 1024)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the node's --max-num-seqs (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="the node's --max-num-batched-tokens (default 16384)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="share of the free device memory the node's KV pool takes (default 0.85)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for every answer; the figures then cover what was answered, and the requests "
                   "still running are counted as unanswered (default 600)")
    p.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                   help="one more kvrt launch argument, repeatable (e.g. --launch-arg=--compute-dtype=float16)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON instead of a table")
    args = p.parse_args(argv)
    if min(args.requests, args.min_len) < 1 or args.max_input_len < args.min_len or args.max_output_len < args.min_len:
        p.error("--requests and --min-len must be positive, and each maximum at least --min-len")
    from kvrt.bench.nodes import LaunchedNode
    from kvrt.ipc.ports import free_port
    from kvrt.runtime.node.status import snapshot

    load = workload(args.requests, args.min_len, args.max_input_len, args.max_output_len)
    longest = max(len(q) for q in load.prompts) + max(load.outputs)
    with tempfile.TemporaryDirectory(prefix="kvrt-bench-throughput-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = os.path.join(tmp, "model")
            t0 = time.perf_counter()
            write_checkpoint(model_dir, args.shape)
            log.info("wrote a random %s checkpoint in %.1f s", args.shape, time.perf_counter() - t0)
        name = f"benchtp{os.getpid()}"
        launch = ["--model", model_dir, "--device", args.device, "--max-model-len", str(max(longest, 64)),
                  "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--ready-timeout", "300", *args.launch_arg]
        if args.device == "cuda":
            launch += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        else:
            launch += ["--num-gpu-blocks", str(-(-sum(len(q) + n for q, n in zip(load.prompts, load.outputs)) // 16) + 64)]
        t0 = time.perf_counter()
        node = LaunchedNode(name, free_port(), launch, lambda line: log.info("%s", line), ready_timeout=330.0)
        try:
            node.wait_ready()
            startup = time.perf_counter() - t0
            prompt_tokens, out, preempt, failed, seconds, left = run(node.port, load, args.timeout)
            steps = int(snapshot(name)["engine"]["steps"])
        finally:
            code = node.stop()
        if code not in (0, None):
            print(f"kvrt bench throughput: the node exited with {code}; its log ends:\n{node.log_tail()}",
                  file=sys.stderr)
    res = Outcome(args.requests, prompt_tokens, out, seconds, out / seconds, prompt_tokens / seconds, steps,
                  (prompt_tokens + out) / max(steps, 1), preempt, failed, left, startup)
    if args.json:
        print(json.dumps({"shape": args.shape if args.model is None else args.model, "device": args.device,
                          "launch": launch[2:], **asdict(res)}))
    else:
        print(f"{res.requests} requests ({args.shape if args.model is None else args.model} on {args.device}): "
              f"{res.output_tokens} output tokens in {res.seconds:.2f} s = {res.output_tokens_s:,.0f} output tokens/s "
              f"(prompt {res.prompt_tokens_s:,.0f} tokens/s); {res.steps} steps, {res.tokens_per_step:.1f} tokens a "
              f"step; {res.preemptions} preemptions; {res.failed} failed; {res.unanswered} unanswered at --timeout; "
              f"node ready in {res.startup_s:.1f} s")
    return 1 if failed or left or code not in (0, None) else 0
