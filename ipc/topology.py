"""A node's shared objects and channels, declared once for a given configuration.

The launcher creates what the declaration lists, each process asks it for its own ends, the
launcher names each ring's two processes from it, and the name check counts it. Each of those
once derived the node's rings for itself, so a new channel or role had to be taught to all of
them alike; now it is one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Iterable

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.allreduce import AllReduce, segment_bytes
from kvrt.ipc.channel import Channel, Receiver, Sender
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.registry import Registry
from kvrt.ipc.signals import Signal

Proc = tuple[int, int]  # (role, rank): one process of the node
ENGINE: Proc = (P.ROLE_ENGINE, 0)
GATEWAY: Proc = (P.ROLE_GATEWAY, 0)

# the signals every node has, whatever its configuration (`kvrt status` reads them)
NODE_SIGNALS = (P.PROCS, P.HEARTBEAT, P.READY, P.NODE_STATUS, P.ERRORS, P.ENGINE_STATS)

# each role of rank processes, with its engine -> rank and rank -> engine channels
_RANK_ROLES: dict[int, tuple[Callable[[int], Channel], Callable[[int], Channel]]] = {
    P.ROLE_WORKER: (P.worker_orders, P.worker_answers),
    P.ROLE_TRANSFER: (P.transfer_orders, P.transfer_answers),
    P.ROLE_MESSAGER: (P.messager_orders, P.messager_answers),
}


@dataclass(frozen=True)
class SignalSpec:
    """A shared array: its short name, shape and dtype."""

    obj: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize

    def create(self, reg: Registry) -> Signal:
        return Signal.create(reg, self.obj, self.shape, np.dtype(self.dtype))


@dataclass(frozen=True)
class Link:
    """One channel and the one process that writes it and the one that reads it. `bell` names
    a doorbell shared with the other rings its reader waits on (None: the ring has its own)."""

    channel: Channel
    producer: Proc
    consumer: Proc
    bell: str | None = None

    def objects(self) -> list[str]:
        """The short names the ring registers: itself, its own doorbell unless shared, its space bell."""
        obj = self.channel.obj
        return [obj, *([f"{obj}.bell"] if self.bell is None else []), f"{obj}.space"]

    def peer(self) -> Proc:
        """The end that is not the engine."""
        return self.consumer if self.producer == ENGINE else self.producer


@dataclass(frozen=True)
class Topology:
    """Every process, signal, doorbell, channel and pool of one node."""

    processes: tuple[Proc, ...]
    signals: tuple[SignalSpec, ...]
    bells: tuple[str, ...]
    links: tuple[Link, ...]
    pools: tuple[str, ...]
    allreduce: tuple[int, int, bool] | None  # (ranks, capacity, peer memory) when the workers sum across ranks

    @classmethod
    def of(cls, cfg: NodeConfig, roles: Iterable[int] | None = None) -> "Topology":
        """The node `cfg` describes. `roles` narrows the rank processes to those roles (a node
        assembled by hand around one of them, as tests and benchmarks do); default: the roles
        the configuration runs, workers always, cache-transfer for a host tier or storage,
        cache-messager on a P or D node, and the gateway (no ring: it talks to the engine over
        private sockets) when the node listens where others reach it."""
        gateway = (GATEWAY,) if roles is None and cfg.has_gateway else ()
        if roles is None:
            roles = [P.ROLE_WORKER] + [P.ROLE_TRANSFER] * cfg.needs_transfer + [P.ROLE_MESSAGER] * cfg.disaggregated
        roles = [r for r in _RANK_ROLES if r in set(roles)]
        slots = len(P.proc_slots(cfg.tp))
        signals = [SignalSpec(P.PROCS, (slots, P.PROC_FIELDS), "int64"), SignalSpec(P.HEARTBEAT, (slots,), "int64"),
                   SignalSpec(P.READY, (slots,), "int32"), SignalSpec(P.NODE_STATUS, (P.STATUS_FIELDS,), "int64"),
                   SignalSpec(P.ERRORS, (slots + 1, P.ERROR_BYTES), "uint8"),
                   SignalSpec(P.ENGINE_STATS, (len(P.STATS),), "float64")]
        if cfg.check_ownership:
            signals += [SignalSpec(P.OWNERS_DEVICE, (cfg.num_gpu_blocks,), "int32"),
                        SignalSpec(P.OWNERS_HOST, (max(cfg.num_cpu_blocks, 1),), "int32")]
        links = []
        for role in roles:
            orders, answers = _RANK_ROLES[role]
            for r in range(cfg.tp):  # the engine waits on every answer ring at once: one shared bell
                links += [Link(orders(r), ENGINE, (role, r)), Link(answers(r), (role, r), ENGINE, P.ENGINE_BELL)]
        pools = [P.device_pool(r) for r in range(cfg.tp)]
        pools += [P.host_pool(r) for r in range(cfg.tp)] if cfg.num_cpu_blocks > 0 else []
        allreduce = ((cfg.tp, cfg.allreduce_capacity, cfg.device == "cuda")
                     if cfg.needs_allreduce and P.ROLE_WORKER in roles else None)
        return cls(processes=(ENGINE, *((role, r) for role in roles for r in range(cfg.tp)), *gateway),
                   signals=tuple(signals), bells=(P.ENGINE_BELL,), links=tuple(links), pools=tuple(pools),
                   allreduce=allreduce)

    # ---- what a process opens --------------------------------------------------------------
    def sends(self, proc: Proc, to: int | None = None) -> list[Link]:
        """The links `proc` writes (those to processes of role `to` only, if given), by rank."""
        return [k for k in self.links if k.producer == proc and (to is None or k.consumer[0] == to)]

    def receives(self, proc: Proc, of: int | None = None) -> list[Link]:
        """The links `proc` reads (those from processes of role `of` only, if given), by rank."""
        return [k for k in self.links if k.consumer == proc and (of is None or k.producer[0] == of)]

    def senders(self, reg: Registry, proc: Proc, to: int | None = None) -> list[Sender]:
        return [Sender.attach(reg, k.channel) for k in self.sends(proc, to)]

    def receivers(self, reg: Registry, proc: Proc, of: int | None = None) -> list[Receiver]:
        return [Receiver.attach(reg, k.channel) for k in self.receives(proc, of)]

    # ---- what the creator makes --------------------------------------------------------------
    def create(self, reg: Registry, ring_bytes: int) -> dict[str, Signal]:
        """Create the signals, the all-reduce, the doorbells and the rings (the config and the
        pools are the caller's: they need the node's data and a device backend). Returns the
        signals, open, by short name; the caller closes them."""
        signals: dict[str, Signal] = {}
        try:
            for spec in self.signals:
                signals[spec.obj] = spec.create(reg)
            if self.allreduce is not None:
                tp, capacity, peer_memory = self.allreduce
                AllReduce.create(reg, P.ALLREDUCE, tp, capacity, peer_memory=peer_memory)
            for bell in self.bells:
                reg.create_doorbell(bell)
            for link in self.links:
                link.channel.create(reg, ring_bytes, bell=link.bell)
        except BaseException:
            for s in signals.values():
                s.close()
            raise
        return signals

    def names(self) -> list[str]:
        """Short names of every object the node registers, the config included."""
        return [P.CONFIG, *(s.obj for s in self.signals), *([P.ALLREDUCE] if self.allreduce else []),
                *self.bells, *(n for k in self.links for n in k.objects()), *self.pools]

    def signal_bytes(self) -> list[int]:
        """The size of each signal and of the all-reduce segment, as created."""
        out = [s.nbytes for s in self.signals]
        if self.allreduce is not None:
            tp, capacity, peer_memory = self.allreduce
            out.append(segment_bytes(tp, capacity, peer_memory=peer_memory))
        return out
