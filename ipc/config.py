"""The node configuration as one typed object both halves of a node read.

The launcher validates it (runtime/node/config.py adds the checks that need runtime/) and publishes
it once into the CONFIG segment as plain data; every child reads it back as this dataclass, so a field is
named in one place and a misspelt one is an AttributeError at the first run, not a KeyError
(or a silent default) in one process of one role.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, TypeVar

from kvrt.ipc.layout import FP8_E4M3, KVLayout, LayerGroups
from kvrt.ipc.protocol import read_config

C = TypeVar("C", bound="NodeConfig")
# --kv-cache-dtype as vLLM names it: auto keeps --dtype; fp8 and fp8_e4m3 are FP8 e4m3 blocks
KV_CACHE_DTYPES = {"auto": "", "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}


@dataclass
class NodeConfig:
    node: str
    role: str = "mixed"
    tp: int = 1
    device: str = "cpu"
    block_size: int = 16
    num_gpu_blocks: int = 512  # on a GPU the launcher's default comes from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # share of a GPU's free memory the default device pool takes
    num_cpu_blocks: int = 0
    storage: str = ""
    storage_secret_file: str = ""  # the node group's storage secret: objects carry a MAC keyed by it
    storage_insecure: bool = False  # a shared store without a secret: its blocks are served unchecked
    host: str = "127.0.0.1"  # interface the client API (and the PD handshake) listen on
    port: int = 0
    metrics_port: int = 0
    kv_events_port: int = 0  # KV events PUB port (replay on the next one; 0 = off), on host
    kv_events_replay_rate: float = 0.0  # replay answers a second (0: runtime/cache/events.py REPLAY_PER_S)
    events_secret_file: str = ""  # the KV events' deployment secret (CURVE, keyed keys); needed beyond loopback
    log_dir: str = ""
    # model shape (the KV pools' block shape follows from it)
    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    dtype: str = "float32"       # the KV blocks' float dtype (unless kv_cache_dtype says FP8)
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: auto (dtype), fp8 or fp8_e4m3 (FP8 e4m3 blocks)
    # each layer's attention window in tokens, 0: full attention (empty: every layer full);
    # from a checkpoint's config.json, or --layer-windows for the reference model
    layer_windows: list = field(default_factory=list)
    vocab_size: int = 512
    max_model_len: int = 4096
    model_seed: int = 0
    model_dir: str = ""          # a Hugging Face checkpoint directory; empty: the reference model
    model_arch: str = ""         # its architecture (config.json), set by the launcher
    model_fingerprint: str = ""  # digest of its config.json, headers and weight samples, set by the launcher
    hidden_size: int = 0         # its hidden size (sizes the tp all-reduce), set by the launcher
    compute_dtype: str = "float32"  # a checkpoint's projections: float32, float16 or bfloat16 (resolved from --compute-dtype)
    model_backend: str = "array"  # how a checkpoint runs: array (NumPy/CuPy) or torch (resolved from --model-backend)
    cuda_graph_max_batch: int = -1  # torch backend on a GPU: decode graphs up to this batch (-1: --max-num-seqs; 0: none)
    threads: int = 0             # BLAS threads of a worker's matmuls on a CPU (0: per step, workers/model/threads.py)
    eviction: str = "adaptive"     # the prefix cache's eviction policy (runtime/cache/policies/base.py names them)
    # scheduling
    max_num_seqs: int = 32             # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (prefill chunks + decodes)
    # prefill/decode disaggregation
    decode_peer: str = ""        # P: the D node's client API address, tcp://HOST:PORT
    pd_transport: str = "shm"    # how P's cache-messagers write into D's pools: shm or mooncake
    pd_timeout: float = 30.0     # P's wait for D's blocks; D's lease on blocks awaiting KV
    pd_dead_after: float = 5.0   # P: a decode node silent this long is gone (at most pd_timeout)
    pd_secret_file: str = ""     # the peers' shared secret (else $KVRT_PD_SECRET); PD roles need one
    pd_peer_max_blocks: int = 0  # D: blocks one peer may ever hold at once, within its fair share (0: the pool)
    pd_peer_max_preallocs: int = 16  # D: preallocations one peer may have waiting for kv-ready (more queue)
    check_ownership: bool = False
    ready_timeout: float = 60.0
    rank_timeout: float = 10.0  # longest wait for a rank's answer to a task
    hang_timeout: float = 5.0   # a ready process whose heartbeat stays still this long (launcher running time) is hung
    launcher_grace: float = 10.0  # the launcher's heartbeat may stand still at least this long (ipc/member.py)
    # guided decoding's compile processes (runtime/grammar/pool.py): how many, and one compile's limits
    grammar_workers: int = 2
    grammar_timeout: float = 20.0
    grammar_memory_mib: int = 4096
    wait_spin_us: int = -1      # the engine's and cache-transfer's waits spin this long before sleeping (-1: auto)

    @property
    def wait_spin_s(self) -> float:
        """--wait-spin-us in seconds; auto is 250 us on a GPU node (cores to spare, and a one-block
        swap answers within that) and none on a CPU node (a spinning process takes a core the
        worker's matmuls need)."""
        us = self.wait_spin_us if self.wait_spin_us >= 0 else (250 if self.device == "cuda" else 0)
        return us / 1e6

    @property
    def kv_dtype(self) -> str:
        """What the KV blocks hold: `dtype`, or FP8 e4m3 for --kv-cache-dtype fp8."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or self.dtype

    @property
    def kv_groups(self) -> LayerGroups:
        """How the layers share the pool's pages (one group of every layer unless some slide)."""
        return LayerGroups.of(self.layer_windows or [0] * self.num_layers)

    @property
    def kv_layout(self) -> KVLayout:
        """One rank's KV block, a page of one layer group (every pool, transport and model of
        the node derives from it)."""
        return KVLayout.of_node(self.kv_groups.page_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                self.kv_dtype, self.tp)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one rank: [layers, K/V, block_size, kv_heads_per_rank, head_dim]."""
        return self.kv_layout.block_shape

    @property
    def block_bytes(self) -> int:
        return self.kv_layout.block_bytes

    @property
    def disaggregated(self) -> bool:
        return self.role != "mixed"

    @property
    def needs_allreduce(self) -> bool:
        """A checkpoint split over ranks sums partial outputs across them."""
        return bool(self.model_dir) and self.tp > 1

    @property
    def allreduce_capacity(self) -> int:
        """Floats one rank contributes to one all-reduce at most: a step's tokens x hidden."""
        return self.max_num_batched_tokens * self.hidden_size

    @property
    def needs_transfer(self) -> bool:
        return self.num_cpu_blocks > 0 or bool(self.storage)

    @property
    def has_gateway(self) -> bool:
        """The node listens where others reach it (its client API, its KV events): the gateway
        process owns those sockets (runtime/gateway/), and the engine listens privately."""
        return bool(self.port or self.kv_events_port)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """The config a dict describes; keys this build does not know are ignored (a status
        reader may be older than the node it reads)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def read(cls: type[C], reg) -> C:
        """The configuration the launcher published for the node of `reg`."""
        return cls.from_dict(read_config(reg))
