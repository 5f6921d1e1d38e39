"""The node configuration: one dataclass, validated once by the launcher, published to every
child through the CONFIG segment as a plain dict (so workers/ never imports runtime/)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property

import numpy as np

from .hashing import ModelIdentity

ROLES = ("mixed", "prefill", "decode")
REFERENCE_ARCH = "kvrt-reference-decoder"  # the built-in fixed-seed model of workers/model.py
DEVICES = ("cpu", "cuda")
PD_TRANSPORTS = ("shm", "mooncake")
LEASE_MARGIN_S = 1.0  # P starts a send only if it ends (at worst) this long before D's lease does


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the value."""


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
    host: str = "127.0.0.1"  # interface the client API (and the PD handshake) listen on
    port: int = 0
    metrics_port: int = 0
    log_dir: str = ""
    # model shape (the KV pools' block shape follows from it)
    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    dtype: str = "float32"
    vocab_size: int = 512
    max_model_len: int = 4096
    model_seed: int = 0
    # scheduling
    max_num_seqs: int = 32             # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (prefill chunks + decodes)
    # prefill/decode disaggregation
    decode_peer: str = ""        # P: the D node's client API address, tcp://HOST:PORT
    pd_transport: str = "shm"    # how P's cache-messagers write into D's pools: shm or mooncake
    pd_timeout: float = 30.0     # P's wait for D's blocks; D's lease on blocks awaiting KV
    pd_secret_file: str = ""     # the peers' shared secret (else $KVRT_PD_SECRET); PD roles need one
    pd_peer_max_blocks: int = 0  # D: blocks one peer may hold at once (0: half the device pool)
    pd_peer_max_preallocs: int = 16  # D: preallocations one peer may have waiting for kv-ready
    check_ownership: bool = False
    ready_timeout: float = 60.0
    rank_timeout: float = 10.0  # longest wait for a rank's answer to a task
    hang_timeout: float = 5.0   # a ready process whose heartbeat is older than this is hung

    def validate(self) -> "NodeConfig":
        from ipc.shm import validate_node_name

        try:
            validate_node_name(self.node)
        except ValueError as e:
            raise ConfigError(f"--node: {e}") from None
        _choice("--role", self.role, ROLES)
        _choice("--device", self.device, DEVICES)
        _choice("--pd-transport", self.pd_transport, PD_TRANSPORTS)
        if self.role == "prefill" and not self.decode_peer:
            raise ConfigError("--role prefill needs --decode-peer tcp://HOST:PORT (the decode node's --port)")
        if self.decode_peer and self.role != "prefill":
            raise ConfigError(f"--decode-peer is for --role prefill, not {self.role}")
        if self.decode_peer and not self.decode_peer.startswith("tcp://"):
            raise ConfigError(f"--decode-peer must look like tcp://HOST:PORT, got {self.decode_peer!r}")
        if self.role == "decode" and not self.port:
            raise ConfigError("--role decode needs --port: prefill nodes reach it there")
        if self.role == "prefill" and not self.port:
            raise ConfigError("--role prefill needs --port: clients send their requests there")
        for name, seconds in (("--pd-timeout", self.pd_timeout), ("--ready-timeout", self.ready_timeout),
                              ("--rank-timeout", self.rank_timeout), ("--hang-timeout", self.hang_timeout)):
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {seconds}")
        if self.disaggregated:
            if self.pd_timeout <= self.rank_timeout + LEASE_MARGIN_S:
                raise ConfigError(f"--pd-timeout {self.pd_timeout:g} must be more than --rank-timeout "
                                  f"{self.rank_timeout:g} + {LEASE_MARGIN_S:g} s: P starts a handoff only if it "
                                  f"can end that long before D's lease does, so every PD request would fail")
            from .pd_auth import load_secret

            try:
                load_secret(self.pd_secret_file)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.pd_peer_max_blocks < 0 or self.pd_peer_max_preallocs <= 0:
            raise ConfigError(f"--pd-peer-max-blocks must be >= 0 and --pd-peer-max-preallocs positive, got "
                              f"{self.pd_peer_max_blocks} and {self.pd_peer_max_preallocs}")
        _positive("--tp", self.tp)
        _positive("--block-size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        _positive("--num-gpu-blocks", self.num_gpu_blocks)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_cpu_blocks < 0:
            raise ConfigError(f"--num-cpu-blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.storage and not self.storage.startswith("file:"):
            raise ConfigError(f"--storage {self.storage!r}: only file:DIR is supported")
        if self.storage == "file:":
            raise ConfigError("--storage file: needs a directory, e.g. file:/var/kvrt")
        for name, port in (("--port", self.port), ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be 0..65535, got {port}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens"):
            _positive("--" + name.replace("_", "-"), getattr(self, name))
        if self.num_kv_heads % self.tp:
            raise ConfigError(f"--tp {self.tp} must divide the {self.num_kv_heads} KV heads")
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            raise ConfigError(f"--dtype {self.dtype!r} is not a numpy dtype") from None
        if dt.kind != "f" or dt.itemsize not in (2, 4, 8):  # an object pool would hold pointers
            raise ConfigError(f"--dtype must be a float dtype (float16, float32, float64), got {self.dtype!r}")
        if self.block_size > self.max_model_len:
            raise ConfigError(f"--block-size {self.block_size} is longer than --max-model-len {self.max_model_len}")
        self._check_shared_names()
        return self

    def shared_objects(self) -> list[str]:
        """Short names of every shared object the launcher registers for this node (a ring
        counts with its doorbells). The longest must fit the name limits and the count the
        registry, or the launch would fail half-way through creating them."""
        from ipc import protocol as P

        objs = [P.CONFIG, P.PROCS, P.HEARTBEAT, P.READY, P.NODE_STATUS, P.ERRORS, P.ENGINE_STATS, P.ENGINE_BELL]
        if self.check_ownership:
            objs += [P.OWNERS_DEVICE, P.OWNERS_HOST]
        for r in range(self.tp):
            pairs = [(P.to_worker(r), P.from_worker(r))]
            if self.needs_transfer:
                pairs.append((P.to_transfer(r), P.from_transfer(r)))
            if self.disaggregated:
                pairs.append((P.to_messager(r), P.from_messager(r)))
            for to, back in pairs:  # `back` rings ring the engine's shared bell
                objs += [to, f"{to}.bell", f"{to}.space", back, f"{back}.space"]
            objs.append(P.device_pool(r))
            if self.num_cpu_blocks > 0:
                objs.append(P.host_pool(r))
        return objs

    def _check_shared_names(self) -> None:
        from ipc.registry import MAX_ENTRIES
        from ipc.shm import object_name

        objs = self.shared_objects()
        longest = max(objs, key=len)
        try:
            object_name(self.node, longest)
        except ValueError:
            raise ConfigError(f"--node {self.node!r} is too long for this node's shared-memory names: "
                              f"the longest, kvrt.{self.node}.{longest}, has "
                              f"{len(f'kvrt.{self.node}.{longest}')} characters") from None
        if len(objs) > MAX_ENTRIES:
            raise ConfigError(f"--tp {self.tp}: this node would need {len(objs)} shared objects but a node's "
                              f"registry holds {MAX_ENTRIES}; lower --tp")

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one rank: [layers, K/V, block_size, kv_heads_per_rank, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads // self.tp, self.head_dim)

    def identity(self) -> ModelIdentity:
        """What this node's KV blocks are: the model (the reference model's weights are a
        function of its seed and shape), the KV layout, the block size and the tp layout."""
        weights = (f"seed={self.model_seed},vocab={self.vocab_size},layers={self.num_layers},"
                   f"kv_heads={self.num_kv_heads},head_dim={self.head_dim}")
        return ModelIdentity(arch=REFERENCE_ARCH, weights=weights, num_layers=self.num_layers,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             dtype=np.dtype(self.dtype).name, block_size=self.block_size, tp=self.tp)

    @cached_property
    def key_root(self) -> bytes:
        """Root of this node's block-key chain (computed once; the config does not change
        after validation)."""
        return self.identity().key_root()

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize

    @property
    def disaggregated(self) -> bool:
        return self.role != "mixed"

    @property
    def peer_max_blocks(self) -> int:
        return self.pd_peer_max_blocks or max(1, self.num_gpu_blocks // 2)

    @property
    def needs_transfer(self) -> bool:
        return self.num_cpu_blocks > 0 or bool(self.storage)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
