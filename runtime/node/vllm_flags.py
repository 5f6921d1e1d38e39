"""vLLM's `vllm serve` flags, and what each one is in kvrt: ONE table, from which `kvrt serve`'s
parser, its translation to `kvrt launch` flags, its refusals and the guide's flag table are all
made.

Why one table: a vLLM user's command line must start a node, or be refused naming the flag and
saying why, for every flag vLLM has; a hand-copied parser, translation and doc would drift apart.
Each row is one of:

- `Same`: vLLM's flag sets a `kvrt launch` flag, its value as given (or through `convert`);
- `Choice`: a flag whose values map one by one to `kvrt launch` flags, a value kvrt does not do
  refused with its reason (`--dtype`, `--kv-cache-dtype`: add a value by adding a row entry);
- `Switch`: a flag without a value, on/off; `launch` is what it adds when given (empty: nothing
  to do, kvrt already behaves so), `refuse_off` the reason its `--no-` form is refused;
- `NoCounterpart`: a vLLM flag kvrt has nothing for: an error naming it, with `why`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable, Union

DEFAULT_HTTP_PORT = 8000  # vllm serve's
DEFAULT_STATS_INTERVAL_S = 10.0  # vLLM logs its stats line every 10 s


@dataclass(frozen=True)
class Same:
    names: tuple[str, ...]
    launch: str                 # the `kvrt launch` flag it sets
    help: str
    metavar: str = "V"
    nargs: Union[str, None] = None
    convert: Callable[[str], list[str]] | None = None  # value -> launch argv (default: [launch, value])


@dataclass(frozen=True)
class Choice:
    names: tuple[str, ...]
    values: dict[str, Union[list[str], str]]  # value -> launch argv, or (a str) why it is refused
    help: str


@dataclass(frozen=True)
class Switch:
    names: tuple[str, ...]
    launch: tuple[str, ...]    # launch argv when given (empty: kvrt does so already)
    help: str
    refuse_off: str = ""       # with it, a `--no-` form exists and is refused with this reason
    off_launch: tuple[str, ...] = ()  # or, the `--no-` form's launch argv


@dataclass(frozen=True)
class NoCounterpart:
    names: tuple[str, ...]
    why: str


Row = Union[Same, Choice, Switch, NoCounterpart]

_DTYPE_WHY = "vLLM's --dtype is the model's compute dtype (kvrt's --compute-dtype)"
_KV_DTYPE_WHY = ("`kvrt launch --kv-cache-dtype`: what the KV blocks hold, auto the model's compute dtype, fp8 "
                 "and fp8_e4m3 FP8 e4m3 with a per-layer scale of 1 (e5m2 and scaled variants are not implemented)")
_LORA = "kvrt serves one checkpoint without LoRA adapters"
_MM = "kvrt serves text-only decoder models (no multimodal inputs)"
_DIST = "kvrt runs one node per machine with tensor parallelism only (--tensor-parallel-size)"
_SPEC = "kvrt has no speculative decoding"
_POOL = "kvrt serves generation only (no pooling, embedding or scoring models)"
_GPU_ONLY = "kvrt's GPU path is CuPy kernels without CUDA graphs or torch.compile, so there is nothing to tune"
_TLS = "kvrt's HTTP server has no TLS: put a TLS-terminating proxy in front of it"
_CORS = "kvrt's HTTP server sends no CORS headers: put a proxy in front of it for browser clients"
_QUANT = "kvrt serves BF16/F16/F32 safetensors checkpoints only (no quantized weights)"
_LOAD = "kvrt reads a checkpoint's safetensors files as they are, memory-mapped"
_TOKENIZER = "kvrt reads the tokenizer.json of the checkpoint directory itself"
_TRACE = "kvrt exports no traces: its Prometheus /metrics and the per-request log lines are what it has"
_EXTERNAL_KV = ("kvrt's KV tiers are its own flags (kvrt launch --num-cpu-blocks, --storage; P/D with --role): "
                "give those after the model instead")


TABLE: tuple[Row, ...] = (
    # ---- the server ------------------------------------------------------------------------
    Same(("--host",), "--http-host", "the HTTP server's interface (default 127.0.0.1; vLLM's default, all "
         "interfaces, is `--host 0.0.0.0`)", "HOST"),
    Same(("--port",), "--http-port", f"the HTTP port (default {DEFAULT_HTTP_PORT})", "PORT"),
    Same(("--api-key",), "--api-key", "every route but GET /health needs `Authorization: Bearer KEY` (default: $VLLM_API_KEY)",
         "KEY"),
    Same(("--served-model-name",), "--served-model-name", "the model ids requests may name; /v1/models "
         "reports the first (default: MODEL as given)", "NAME", nargs="+"),
    Same(("--chat-template",), "--chat-template", "a chat template file, or the template itself inline, "
         "instead of the tokenizer's", "FILE|TEMPLATE"),
    Same(("--tool-call-parser",), "--tool-call-parser", "hermes or llama3_json", "NAME"),
    Same(("--reasoning-parser",), "--reasoning-parser", "qwen3: <think>...</think> into reasoning_content", "NAME"),
    Same(("--uvicorn-log-level",), "--uvicorn-log-level", "the HTTP server's own log level", "LEVEL"),
    Switch(("--disable-uvicorn-access-log",), ("--no-access-log",), "no access log line per HTTP request"),
    Switch(("--disable-log-stats",), ("--log-stats-interval", "0"), "no periodic stats line"),
    Switch(("--enable-log-requests",), ("--log-requests",), "log each request's parameters when it arrives"),
    Switch(("--disable-log-requests",), (), "the default: requests' parameters are not logged"),
    Same(("--max-log-len",), "", "(accepted: kvrt never logs prompts' text)", "N", convert=lambda v: []),
    Switch(("--enable-auto-tool-choice",), (), "kvrt reads tool calls with tool_choice auto whenever it "
           "knows the format (--tool-call-parser or the chat template's)"),
    Switch(("--disable-fastapi-docs",), (), "kvrt serves no API docs pages anyway"),
    Switch(("--enable-prompt-tokens-details",), (), "usage.prompt_tokens_details.cached_tokens is always "
           "there"),
    Switch(("--trust-remote-code",), (), "accepted and ignored: kvrt never runs a checkpoint's own code, only "
           "its built-in architectures (Llama, Qwen2, Qwen3)"),
    Switch(("--enforce-eager",), (), "kvrt has no CUDA graphs: it always runs eagerly"),
    # ---- the model ------------------------------------------------------------------------
    Same(("--model",), "", "the model, as the positional MODEL (a directory or a hub id in the local "
         "Hugging Face cache)", "MODEL", convert=lambda v: []),
    Choice(("--dtype",), {"auto": ["--compute-dtype", "auto"], "half": ["--compute-dtype", "float16"],
                          "float16": ["--compute-dtype", "float16"], "bfloat16": ["--compute-dtype", "bfloat16"],
                          "float": ["--compute-dtype", "float32"], "float32": ["--compute-dtype", "float32"]},
           f"the model's compute dtype ({_DTYPE_WHY})"),
    Choice(("--kv-cache-dtype",), {"auto": [], "fp8": ["--kv-cache-dtype", "fp8"],
                                   "fp8_e4m3": ["--kv-cache-dtype", "fp8_e4m3"]}, _KV_DTYPE_WHY),
    Same(("--max-model-len",), "--max-model-len", "longest prompt + output (default: the checkpoint's "
         "max_position_embeddings)", "N"),
    Same(("--seed",), "--seed", "HTTP requests without a seed draw theirs from this one, in arrival order", "N"),
    Same(("--revision",), "", "the hub id's revision in the local cache (a branch, tag or commit)", "REV",
         convert=lambda v: []),
    Same(("--download-dir",), "", "the Hugging Face cache directory to look the hub id up in (default: "
         "$HF_HUB_CACHE, else $HF_HOME/hub)", "DIR", convert=lambda v: []),
    Switch(("--enable-chunked-prefill",), (), "kvrt always chunks prefills under --max-num-batched-tokens",
           refuse_off="kvrt always chunks prefills (under --max-num-batched-tokens)"),
    Choice(("--load-format",), {"auto": [], "safetensors": []}, f"auto or safetensors ({_LOAD})"),
    Choice(("--scheduling-policy",), {"fcfs": []}, "fcfs only (kvrt schedules first come, first served)"),
    Choice(("--generation-config",), {"vllm": []}, "vllm only: kvrt does not read a checkpoint's "
           "generation_config.json for default sampling parameters"),
    Same(("--max-logprobs",), "", "20 only: kvrt's most alternatives per token", "N",
         convert=lambda v: [] if v == "20" else ["--refuse", f"--max-logprobs {v}: kvrt answers at most 20 "
                                                 f"alternatives per token (its fixed limit)"]),
    # ---- parallelism, cache and scheduler -------------------------------------------------
    Same(("--tensor-parallel-size", "-tp"), "--tp", "tensor-parallel ranks", "N"),
    Switch(("--enable-prefix-caching",), (), "the default: kvrt is a prefix cache",
           refuse_off="kvrt is a prefix cache: it cannot serve without one"),
    Same(("--block-size",), "--block-size", "tokens per KV block (a power of two)", "N"),
    Same(("--gpu-memory-utilization",), "--gpu-memory-utilization", "share of the GPU's free memory the KV "
         "pool takes", "F"),
    Same(("--num-gpu-blocks-override",), "--num-gpu-blocks", "device KV blocks per rank", "N"),
    Same(("--swap-space",), "--swap-space", "GiB of host (CPU) KV blocks per rank: kvrt's host tier", "GIB"),
    Same(("--kv-offloading-size",), "--swap-space", "GiB of host (CPU) KV blocks per rank: kvrt's host tier",
         "GIB"),
    Choice(("--kv-offloading-backend",), {"native": []}, "native only (kvrt's own host tier)"),
    Same(("--max-num-seqs",), "--max-num-seqs", "sequences per step", "N"),
    Same(("--max-num-batched-tokens",), "--max-num-batched-tokens", "tokens per step", "N"),
    # ---- what kvrt has no counterpart for ---------------------------------------------------
    NoCounterpart(("--tokenizer", "--tokenizer-mode", "--tokenizer-revision", "--skip-tokenizer-init",
                   "--hf-config-path", "--config-format", "--hf-overrides"), _TOKENIZER),
    NoCounterpart(("--quantization", "-q", "--calculate-kv-scales"), _QUANT),
    NoCounterpart(("--download-dir-strategy", "--safetensors-load-strategy", "--model-loader-extra-config",
                   "--ignore-patterns", "--use-tqdm-on-load", "--pt-load-map-location", "--code-revision",
                   "--hf-token"), _LOAD),
    NoCounterpart(("--rope-scaling", "--rope-theta"), "kvrt reads RoPE from the checkpoint's config.json"),
    NoCounterpart(("--runner", "--convert", "--task", "--pooler-config", "--override-pooler-config"), _POOL),
    NoCounterpart(("--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--data-parallel-rank",
                   "-dpn", "--data-parallel-start-rank", "-dpr", "--data-parallel-size-local", "-dpl",
                   "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp", "--data-parallel-backend",
                   "-dpb", "--data-parallel-hybrid-lb", "--data-parallel-external-lb", "--enable-expert-parallel",
                   "-ep", "--enable-eplb", "--eplb-config", "--enable-dbo", "--decode-context-parallel-size",
                   "-dcp", "--distributed-executor-backend", "--max-parallel-loading-workers",
                   "--ray-workers-use-nsight", "--disable-custom-all-reduce", "--worker-cls",
                   "--worker-extension-cls", "--all2all-backend", "--api-server-count", "-asc", "--headless",
                   "--nnodes", "--node-rank", "--master-addr", "--master-port"), _DIST),
    NoCounterpart(("--enable-lora", "--enable-lora-bias", "--max-loras", "--max-lora-rank",
                   "--lora-extra-vocab-size", "--lora-dtype", "--max-cpu-loras", "--fully-sharded-loras",
                   "--lora-modules", "--default-mm-loras"), _LORA),
    NoCounterpart(("--limit-mm-per-prompt", "--media-io-kwargs", "--mm-processor-kwargs", "--mm-processor-cache-gb",
                   "--disable-mm-preprocessor-cache", "--mm-processor-cache-type", "--mm-shm-cache-max-object-size-mb",
                   "--mm-encoder-tp-mode", "--interleave-mm-strings", "--skip-mm-profiling",
                   "--allowed-local-media-path", "--allowed-media-domains", "--enable-prompt-embeds",
                   "--enable-multimodal-encoder-data-parallel", "--disable-chunked-mm-input"), _MM),
    NoCounterpart(("--speculative-config", "--num-lookahead-slots"), _SPEC),
    NoCounterpart(("--compilation-config", "-O", "--cuda-graph-sizes", "--cudagraph-capture-sizes",
                   "--disable-cascade-attn", "--model-impl", "--override-attention-dtype", "--async-scheduling",
                   "--enable-sleep-mode", "--kv-sharing-fast-prefill",
                   "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--device", "--max-seq-len-to-capture"),
                  _GPU_ONLY),
    NoCounterpart(("--disable-hybrid-kv-cache-manager",), "kvrt always keeps a model's sliding-window and "
                  "full-attention layers in layer groups of their own pages (a sliding group's pages given back "
                  "once its window has left them); it has no mode that keeps every page"),
    NoCounterpart(("--cpu-offload-gb",), "kvrt keeps the weights on the device; its host tier holds KV blocks "
                  "(--swap-space)"),
    NoCounterpart(("--kv-cache-memory-bytes",), "size the device pool with --num-gpu-blocks-override or "
                  "--gpu-memory-utilization"),
    NoCounterpart(("--prefix-caching-hash-algo",), "kvrt keys its blocks with its own chain of hashes, rooted "
                  "in the model's identity"),
    NoCounterpart(("--max-num-partial-prefills", "--max-long-partial-prefills", "--long-prefill-token-threshold",
                   "--scheduler-cls"), "kvrt's scheduler has one knob for prefill chunks: "
                  "--max-num-batched-tokens"),
    NoCounterpart(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--enable-ssl-refresh"),
                  _TLS),
    NoCounterpart(("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials"), _CORS),
    NoCounterpart(("--root-path", "--middleware", "--log-config-file", "--disable-frontend-multiprocessing",
                   "--enable-request-id-headers", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
                   "--h11-max-incomplete-event-size", "--h11-max-header-count", "--log-error-stack",
                   "--enable-log-outputs", "--aggregate-engine-logging", "--tool-server", "--tool-parser-plugin",
                   "--reasoning-parser-plugin", "--exclude-tools-when-tool-choice-none", "--response-role",
                   "--return-tokens-as-token-ids", "--trust-request-chat-template", "--chat-template-content-format",
                   "--enable-force-include-usage", "--logits-processors", "--logits-processor-pattern",
                   "--logprobs-mode", "--io-processor-plugin", "--override-generation-config",
                   "--disable-sliding-window", "--additional-config"),
                  "kvrt's HTTP server has no such option (docs/guide.md lists what it does)"),
    NoCounterpart(("--guided-decoding-backend", "--structured-outputs-config"), "kvrt's structured output has "
                  "one backend (outlines-core): nothing to choose"),
    NoCounterpart(("--otlp-traces-endpoint", "--collect-detailed-traces", "--show-hidden-metrics-for-version"),
                  _TRACE),
    NoCounterpart(("--kv-transfer-config", "--kv-events-config"), _EXTERNAL_KV),
    NoCounterpart(("--config",), "give the flags on the command line (kvrt launch --config reads kvrt's own "
                  "flags from a file)"),
)


@dataclass
class Translation:
    """What `kvrt serve`'s vLLM flags come to: the `kvrt launch` argv, or the first refusal."""

    launch: list[str] = field(default_factory=list)
    refusal: str = ""


def names() -> dict[str, Row]:
    """Every vLLM spelling (long and short) -> its row."""
    out: dict[str, Row] = {}
    for row in TABLE:
        for n in row.names:
            if n in out:
                raise ValueError(f"{n} is in the vLLM flag table twice")
            out[n] = row
        if isinstance(row, Switch) and (row.refuse_off or row.off_launch):
            out["--no-" + row.names[0][2:]] = row
    return out


def normalize(arg: str) -> str:
    """vLLM's parser takes `--max_model_len` for `--max-model-len`: the same here (the value after
    `=` untouched)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def add_to(parser: argparse.ArgumentParser) -> None:
    """The table's flags (those kvrt does something for) on `kvrt serve`'s parser, each stored
    under its row's index so that `translate` finds the row back."""
    group = parser.add_argument_group("vLLM's flags (docs/guide.md: `kvrt serve`)")
    for i, row in enumerate(TABLE):
        dest = f"vllm_{i}"
        if isinstance(row, Same):
            group.add_argument(*row.names, dest=dest, metavar=row.metavar, nargs=row.nargs, help=row.help)
        elif isinstance(row, Choice):
            group.add_argument(*row.names, dest=dest, metavar="{" + ",".join(row.values) + "}", help=row.help)
        elif isinstance(row, Switch):
            group.add_argument(*row.names, dest=dest, action="store_const", const=True, help=row.help)
            if row.refuse_off or row.off_launch:
                group.add_argument("--no-" + row.names[0][2:], dest=dest, action="store_const", const=False,
                                   help=argparse.SUPPRESS)


def first_without_counterpart(argv: list[str]) -> str | None:
    """The error for the first flag of `argv` that is one of vLLM's with no kvrt counterpart, or
    None. Read before parsing, since such a flag's values are unknown to kvrt's parser."""
    table = names()
    for arg in argv:
        if arg == "--":
            return None
        name = normalize(arg).split("=", 1)[0]
        row = table.get(name)
        if isinstance(row, NoCounterpart):
            return f"vLLM's {name} has no counterpart in kvrt: {row.why}"
    return None


def translate(ns: argparse.Namespace) -> Translation:
    """The `kvrt launch` argv for the table's flags in `ns`, or the first refusal."""
    out = Translation()
    for i, row in enumerate(TABLE):
        value = getattr(ns, f"vllm_{i}", None)
        if value is None:
            continue
        if isinstance(row, Same):
            values = value if isinstance(value, list) else [value]
            if row.convert is not None:
                argv = row.convert(values[0])
                if argv[:1] == ["--refuse"]:
                    out.refusal = argv[1]
                    return out
                out.launch += argv
            else:
                out.launch += [row.launch, *values]
        elif isinstance(row, Choice):
            got = row.values.get(value)
            if got is None:
                out.refusal = f"{row.names[0]} {value}: kvrt takes {', '.join(row.values)} ({row.help})"
                return out
            if isinstance(got, str):
                out.refusal = f"{row.names[0]} {value}: {got}"
                return out
            out.launch += got
        elif isinstance(row, Switch):
            if value:
                out.launch += list(row.launch)
            elif row.refuse_off:
                out.refusal = f"--no-{row.names[0][2:]}: {row.refuse_off}"
                return out
            else:
                out.launch += list(row.off_launch)
    return out


def markdown_table() -> str:
    """The guide's table of vLLM's flags (docs/guide.md holds it verbatim; tests/test_docs.py
    checks it is this)."""
    lines = ["| vLLM flag | in kvrt |", "|---|---|"]
    for row in TABLE:
        flags = ", ".join(f"`{n}`" for n in row.names)
        if isinstance(row, Same):
            what = f"`kvrt launch {row.launch}`: {row.help}" if row.launch else row.help
        elif isinstance(row, Choice):
            what = row.help + ": " + ", ".join(f"`{v}`" for v in row.values)
        elif isinstance(row, Switch):
            what = row.help + (f" (`{' '.join(row.launch)}`)" if row.launch else "")
            if row.refuse_off:
                flags += f", `--no-{row.names[0][2:]}` (refused)"
        else:
            what = f"refused: {row.why}"
        lines.append(f"| {flags} | {what} |")
    return "\n".join(lines)
