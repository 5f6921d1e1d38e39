"""The node configuration's validation and identity: the typed fields live in ipc/config.py,
where workers/ reads them too (workers/ never imports runtime/); what needs runtime/ (the PD
secret, the model identity) is added here, and the launcher validates once before publishing."""
from __future__ import annotations

import math
import os
from functools import cached_property

import numpy as np

from kvrt.ipc import config

from kvrt.runtime.cache.keys import ModelIdentity
from kvrt.runtime.cache.policies.base import policy_names

ROLES = ("mixed", "prefill", "decode")
REFERENCE_ARCH = "kvrt-reference-decoder"  # the built-in fixed-seed model of workers/model/transformer.py
DEVICES = ("cpu", "cuda")
COMPUTE_DTYPES = ("float32", "float16")  # what workers/model/hf_model.py multiplies a checkpoint's projections in
MODEL_BACKENDS = ("array", "torch")  # workers/model/transformer.py's NumPy/CuPy path, or workers/model/torch_backend.py
PD_TRANSPORTS = ("shm", "mooncake")
LEASE_MARGIN_S = 1.0  # P starts a send only if it ends (at worst) this long before D's lease does


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the value."""


class NodeConfig(config.NodeConfig):
    """The typed node configuration (ipc/config.py) plus what only the launcher and the engine
    need: validation of user input and the model identity block keys are rooted in."""

    @property
    def decode_peers(self) -> list[str]:
        """The decode nodes of a prefill node (--decode-peer, comma-separated), in order."""
        return [p.strip() for p in self.decode_peer.split(",") if p.strip()] if self.decode_peer else []

    def validate(self) -> "NodeConfig":
        from kvrt.ipc.shm import validate_node_name

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
        for peer in self.decode_peers:
            host, _, port = peer.removeprefix("tcp://").rpartition(":")
            if not peer.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--decode-peer takes tcp://HOST:PORT addresses, comma-separated; got {peer!r}")
        if len(set(self.decode_peers)) != len(self.decode_peers):
            raise ConfigError(f"--decode-peer names a decode node twice: {self.decode_peer!r}")
        if self.role == "decode" and not self.port:
            raise ConfigError("--role decode needs --port: prefill nodes reach it there")
        if self.role == "prefill" and not self.port:
            raise ConfigError("--role prefill needs --port: clients send their requests there")
        for name, seconds in (("--pd-timeout", self.pd_timeout), ("--pd-dead-after", self.pd_dead_after),
                              ("--ready-timeout", self.ready_timeout),
                              ("--rank-timeout", self.rank_timeout), ("--hang-timeout", self.hang_timeout),
                              ("--launcher-grace", self.launcher_grace)):
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {seconds}")
        if not (math.isfinite(self.grammar_timeout) and self.grammar_timeout > 0):
            raise ConfigError(f"--grammar-timeout must be a positive number of seconds, got {self.grammar_timeout}")
        if not 1 <= self.grammar_workers <= 64:
            raise ConfigError(f"--grammar-workers must be between 1 and 64, got {self.grammar_workers}")
        if not 64 <= self.grammar_memory_mib <= 1 << 20:
            raise ConfigError(f"--grammar-memory-mib must be between 64 and {1 << 20}, got {self.grammar_memory_mib}")
        if self.disaggregated:
            if self.pd_timeout <= self.rank_timeout + LEASE_MARGIN_S:
                raise ConfigError(f"--pd-timeout {self.pd_timeout:g} must be more than --rank-timeout "
                                  f"{self.rank_timeout:g} + {LEASE_MARGIN_S:g} s: P starts a handoff only if it "
                                  f"can end that long before D's lease does, so every PD request would fail")
            from kvrt.runtime.pd.auth import load_secret

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
        if self.eviction not in policy_names():
            raise ConfigError(f"--eviction {self.eviction!r}: known policies are {', '.join(policy_names())}")
        if self.storage:
            self._validate_storage()
        for name, port in (("--port", self.port), ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be 0..65535, got {port}")
        if not 0 <= self.kv_events_port <= 65534:
            raise ConfigError(f"--kv-events-port must be 0..65534 (replay listens on the next port), "
                              f"got {self.kv_events_port}")
        if not (math.isfinite(self.kv_events_replay_rate) and self.kv_events_replay_rate >= 0):
            raise ConfigError(f"--kv-events-replay-rate must be a finite number >= 0 (0: the default), "
                              f"got {self.kv_events_replay_rate}")
        self._check_events_secret()
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens"):
            _positive("--" + name.replace("_", "-"), getattr(self, name))
        if self.model_dir and not (self.model_arch and self.model_fingerprint):
            raise ConfigError(f"--model {self.model_dir}: its architecture and fingerprint must come from "
                              f"the checkpoint (workers.checkpoint.inspect)")
        if self.model_dir and self.hidden_size <= 0:
            raise ConfigError(f"--model {self.model_dir}: hidden_size must come from its config.json")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or not all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.layer_windows)):
            raise ConfigError(f"--layer-windows must give each of the {self.num_layers} layers a window of "
                              f"0 (full attention) or more tokens, got {self.layer_windows}")
        if self.num_kv_heads % self.tp:
            raise ConfigError(f"--tp {self.tp} must divide the {self.num_kv_heads} KV heads")
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            raise ConfigError(f"--dtype {self.dtype!r} is not a numpy dtype") from None
        if dt.kind != "f" or dt.itemsize not in (2, 4, 8):  # an object pool would hold pointers
            raise ConfigError(f"--dtype must be a float dtype (float16, float32, float64), got {self.dtype!r}")
        _choice("--kv-cache-dtype", self.kv_cache_dtype, tuple(config.KV_CACHE_DTYPES))
        computes = COMPUTE_DTYPES + (("bfloat16",) if self.model_backend == "torch" else ())
        if self.compute_dtype not in computes or (self.compute_dtype != "float32" and not self.model_dir):
            raise ConfigError(f"--compute-dtype resolves to {', '.join(computes)} for a --model checkpoint "
                              f"(float32 otherwise), got {self.compute_dtype!r}")
        if self.model_backend not in MODEL_BACKENDS or (self.model_backend == "torch" and not self.model_dir):
            raise ConfigError(f"--model-backend resolves to {', '.join(MODEL_BACKENDS)} (torch for a --model "
                              f"checkpoint only), got {self.model_backend!r}")
        if self.model_backend == "torch" and (self.kv_cache_dtype != "auto" or self.layer_windows):
            raise ConfigError("--model-backend torch keeps K/V as they are over one block table: it serves neither "
                              "FP8 blocks (--kv-cache-dtype) nor sliding windows and their layer groups "
                              "(--layer-windows); use --model-backend array")
        if self.wait_spin_us < -1 or self.wait_spin_us > 100_000:
            raise ConfigError(f"--wait-spin-us must be between 0 and 100000 (or -1: auto), got {self.wait_spin_us}")
        if self.cuda_graph_max_batch < -1:
            raise ConfigError(f"--cuda-graph-max-batch must be >= 0 (or -1: --max-num-seqs), got "
                              f"{self.cuda_graph_max_batch}")
        if self.threads < 0:
            raise ConfigError(f"--threads must be >= 0 (0: auto), got {self.threads}")
        if self.block_size > self.max_model_len:
            raise ConfigError(f"--block-size {self.block_size} is longer than --max-model-len {self.max_model_len}")
        self._check_shared_names()
        return self

    def _check_events_secret(self) -> None:
        """KV events beyond loopback need the deployment secret: without it anyone who reaches
        the port reads which prompts are cached (runtime/cache/event_secret.py)."""
        from kvrt.runtime.cache.event_secret import MAKE_SECRET_HINT, EventSecret, needs_secret

        if self.events_secret_file and not self.kv_events_port:
            raise ConfigError("--events-secret-file guards the KV events: it needs --kv-events-port")
        if self.kv_events_port and not self.events_secret_file and needs_secret(self.host):
            raise ConfigError(f"--kv-events-port on --host {self.host} (not loopback) needs --events-secret-file: "
                              f"the events tell which prompts are cached; {MAKE_SECRET_HINT}")
        if self.events_secret_file:
            try:
                EventSecret.load(self.events_secret_file)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def _validate_storage(self) -> None:
        """The storage setting, its secret, and the default that keeps a shared store from
        serving blocks anyone could have written: a Mooncake store takes objects from whoever
        reaches its master or a process lending it memory (it has no authentication), so a
        node on one needs a storage secret, or --storage-insecure to accept that. A file
        directory must be this user's own and closed to others; a secret is optional there
        (only this user and root can write into it) and guards against their other processes."""
        from kvrt.ipc.private import check_private_dir, read_secret_file
        from kvrt.ipc.storage_uri import MAKE_SECRET_HINT, parse_storage

        try:
            spec = parse_storage(self.storage)
        except ValueError as e:
            raise ConfigError(f"--storage: {e}") from None
        if self.storage_secret_file and self.storage_insecure:
            raise ConfigError("--storage-secret-file and --storage-insecure contradict each other: give one")
        if self.storage_secret_file:
            try:
                read_secret_file(self.storage_secret_file, "--storage-secret-file", MAKE_SECRET_HINT)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif spec.shared and not self.storage_insecure:
            raise ConfigError(f"--storage {self.storage} is a store other parties can write to (it has no "
                              f"authentication): give the node group's secret with --storage-secret-file, "
                              f"so that every block carries a MAC and a forged one is never served, or "
                              f"--storage-insecure to serve its blocks unchecked; {MAKE_SECRET_HINT}")
        if not spec.shared:
            try:
                if os.path.exists(spec.path):
                    check_private_dir(spec.path, "--storage directory")
            except (ValueError, OSError) as e:
                raise ConfigError(str(e)) from None

    def shared_objects(self) -> list[str]:
        """Short names of every shared object the launcher registers for this node (a ring
        counts with its doorbells). The longest must fit the name limits and the count the
        registry, or the launch would fail half-way through creating them."""
        from kvrt.ipc.topology import Topology

        return Topology.of(self).names()

    def _check_shared_names(self) -> None:
        from kvrt.ipc.registry import MAX_ENTRIES
        from kvrt.ipc.shm import object_name

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

    def identity(self) -> ModelIdentity:
        """What this node's KV blocks are: the model (a checkpoint's fingerprint covers its
        config, where every tensor lies and a sample of its bytes; the reference model's weights
        are a function of its seed and shape, and float16 compute is part of it: its KV bytes are
        not float32 compute's), the KV layout, the block size and the tp layout."""
        if self.model_dir:
            arch, weights = self.model_arch, f"checkpoint={self.model_fingerprint}"
            if self.compute_dtype != "float32":  # float16 arithmetic computes other KV bytes
                weights += f",compute={self.compute_dtype}"
            if self.model_backend != "array":  # other kernels round in another order: other KV bytes
                weights += f",backend={self.model_backend}"
        else:
            arch = REFERENCE_ARCH
            weights = (f"seed={self.model_seed},vocab={self.vocab_size},layers={self.num_layers},"
                       f"kv_heads={self.num_kv_heads},head_dim={self.head_dim}")
        groups = self.kv_groups
        return ModelIdentity(arch=arch, weights=weights, num_layers=self.num_layers,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             dtype=self.kv_layout.dtype, block_size=self.block_size, tp=self.tp,
                             layer_groups=groups.describe() if groups.hybrid else "")

    @cached_property
    def key_root(self) -> bytes:
        """Root of this node's block-key chain (computed once; the config does not change
        after validation)."""
        return self.identity().key_root()


def _choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
