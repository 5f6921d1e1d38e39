"""worker[r]: the model runner of rank r. It reads and writes only its rank's device KV pool,
and only the blocks of the step batch the engine just sent it (the ownership rule): between
receiving a step and publishing its answer, nothing else touches those blocks.

The model is a Hugging Face checkpoint's (workers/hf_model.py) with --model: with --tp N rank r
holds its N-th of the heads, KV heads and MLP, and the ranks sum their partial outputs through
the node's all-reduce (ipc/allreduce.py; on a GPU over CUDA IPC buffers,
workers/cuda_allreduce.py), so every rank computes the same tokens. Without --model it is the reference transformer (workers/model.py), where tensor parallelism is not split
inside the model yet: with --tp N every rank runs the same model over its N-th of the KV
heads and its own pool, so every rank's pool holds real KV (swaps and P->D sends of each rank
carry meaningful bytes); rank 0's tokens are the answer, the others acknowledge.
"""
from __future__ import annotations

import logging
import sys
import time

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.allreduce import AllReduce
from kvrt.ipc.ownership import OwnershipError, check_owners
from kvrt.ipc.signals import Signal
from kvrt.ipc.topology import Topology

from kvrt.workers.backend import get_backend
from kvrt.workers.child import Child, run_child
from kvrt.workers.cuda_allreduce import peer_memory
from kvrt.workers.hf_model import HFModel
from kvrt.workers.kv_pool import attach_pools
from kvrt.workers.model import Model, ModelShape, SeqInput
from kvrt.workers.sampler import SamplingRows, sample
from kvrt.workers.threads import BlasThreads, usable_cores

log = logging.getLogger("kvrt.workers.worker")
_NO_TOKENS = np.empty(0, dtype=np.int32)


class Worker:
    def __init__(self, child: Child):
        self.child = child
        cfg = child.cfg
        self.device, self.host = attach_pools(child.reg, child.rank, cfg)
        self.xp = get_backend(cfg.device).xp
        self.threads = BlasThreads(cfg.threads, usable_cores(cfg.tp))
        self.allreduce = (AllReduce.attach(child.reg, P.ALLREDUCE, child.rank, cfg.rank_timeout,
                                           memory=peer_memory(cfg.device))
                          if cfg.needs_allreduce else None)
        if cfg.model_dir:
            self.model = HFModel.load(cfg.model_dir, cfg.model_fingerprint, cfg.max_model_len, self.xp,
                                      kv_dtype=cfg.dtype, rank=child.rank, tp=cfg.tp,
                                      allreduce=self.allreduce.sum if self.allreduce else None,
                                      matmul_dtype=cfg.compute_dtype)
        else:
            self.model = Model(ModelShape.from_config(cfg), self.xp, kv_dtype=cfg.dtype)
        if cfg.device == "cuda":  # CuPy's kernels compiled now, before ready, not in the first step
            self.model.warm_up(cfg.block_size)
        self.model.beat = child.member.beat
        self.block_size = cfg.block_size
        self.owners = Signal.attach(child.reg, P.OWNERS_DEVICE).array if cfg.check_ownership else None
        me, topo = (P.ROLE_WORKER, child.rank), Topology.of(cfg)
        [self.orders], [self.answers] = topo.receivers(child.reg, me), topo.senders(child.reg, me)

    def serve(self) -> int:
        log.info("serving %s: %d device blocks, model %s, ownership checks %s", self.orders.name,
                 self.device.num_blocks, self.model.shape, "on" if self.owners is not None else "off")
        self.child.set_ready()
        return self.child.serve_orders(self.orders, self.answers, {P.StepBatch: self.run_step})

    def run_step(self, step: P.StepBatch) -> P.StepResult:
        """Compute one step; any failure becomes an error answer, never an exit."""
        t0 = time.perf_counter()
        try:
            seqs = self._inputs(step)
            if self.owners is not None:
                self._check_owned(step.step_id, seqs)
            rows = self._sampling(step)
            with self.threads.for_rows(len(step.tokens)):
                logits = self.model.step_logits(self.device.array, seqs)
                if self.child.rank == 0:
                    tokens, logprobs = sample(logits, rows, np)
        except (ValueError, OwnershipError) as e:
            log.error("step %d failed: %s", step.step_id, e)
            return P.StepResult(step.step_id, self.child.rank, _NO_TOKENS, time.perf_counter() - t0,
                                f"worker[{self.child.rank}] step {step.step_id}: {e}")
        if self.child.rank != 0:
            return P.StepResult(step.step_id, self.child.rank, _NO_TOKENS, time.perf_counter() - t0)
        return P.StepResult(step.step_id, self.child.rank, tokens, time.perf_counter() - t0,
                            logprobs=logprobs.tolist() if rows.logprobs.any() else [])

    def _inputs(self, step: P.StepBatch) -> list[SeqInput]:
        n = len(step.query_lens)
        if not (len(step.starts) == len(step.table_lens) == n and int(step.query_lens.sum()) == len(step.tokens)
                and int(step.table_lens.sum()) == len(step.tables)):
            raise ValueError("step batch fields do not agree in length")
        q_off = np.concatenate([[0], np.cumsum(step.query_lens)])
        t_off = np.concatenate([[0], np.cumsum(step.table_lens)])
        return [SeqInput(step.tokens[q_off[i]:q_off[i + 1]], int(step.starts[i]), step.tables[t_off[i]:t_off[i + 1]])
                for i in range(n)]

    @staticmethod
    def _sampling(step: P.StepBatch) -> SamplingRows:
        """The batch's per-sequence sampling parameters (none at all: every sequence greedy);
        each sampled token's position is where its sequence's step ends."""
        n = len(step.query_lens)
        fields = (step.temperature, step.top_p, step.top_k, step.seed, step.logprobs)
        if all(len(f) == 0 for f in fields):
            return SamplingRows.greedy(n)
        if any(len(f) != n for f in fields):
            raise ValueError(f"step batch sampling fields do not have one entry for each of its {n} sequences")
        try:
            rows = SamplingRows(np.asarray(step.temperature, np.float64), np.asarray(step.top_p, np.float64),
                                np.asarray(step.top_k, np.int64), np.asarray(step.seed, np.uint64),
                                step.starts.astype(np.int64) + step.query_lens, np.asarray(step.logprobs) != 0)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"step batch sampling fields: {e}") from None
        if not (np.all(rows.temperature >= 0) and np.all((rows.top_p > 0) & (rows.top_p <= 1))
                and np.all(rows.top_k >= 0)):
            raise ValueError("step batch sampling fields out of range")
        return rows

    def _check_owned(self, step_id: int, seqs: list[SeqInput]) -> None:
        """Debug mode: blocks this step writes must be the worker's; blocks it reads must hold
        written KV (the worker's own, or the prefix cache's, possibly being copied out)."""
        bs = self.block_size
        what = f"step {step_id} on worker[{self.child.rank}]"
        for s in seqs:
            first = s.start // bs
            check_owners(self.owners, s.block_table[first:], "device", what, P.OWNER_WORKER)
            check_owners(self.owners, s.block_table[:first], "device", what,
                         (P.OWNER_WORKER, P.OWNER_CACHE, P.OWNER_TRANSFER))

    def close(self) -> None:
        self.answers.close()
        self.orders.detach()
        if self.allreduce is not None:
            self.allreduce.close()
        for pool in (self.device, self.host):
            if pool is not None:
                pool.close()


def main(argv: list[str] | None = None) -> int:
    return run_child(P.ROLE_WORKER, Worker, argv)


if __name__ == "__main__":
    sys.exit(main())
