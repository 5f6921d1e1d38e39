"""worker[r]: the model runner of rank r. It reads and writes only its rank's device KV pool,
and only the blocks of the step batch the engine just sent it (the ownership rule): between
receiving a step and publishing its answer, nothing else touches those blocks.

The model is a Hugging Face checkpoint's (workers/model/hf_model.py) with --model: with --tp N rank r
holds its N-th of the heads, KV heads and MLP, and the ranks sum their partial outputs through
the node's all-reduce (ipc/allreduce.py; on a GPU over CUDA IPC buffers,
workers/cuda_allreduce.py), so every rank computes the same tokens. Without --model it is the reference transformer (workers/model/transformer.py), where tensor parallelism is not split
inside the model yet: with --tp N every rank runs the same model over its N-th of the KV
heads and its own pool, so every rank's pool holds real KV (swaps and P->D sends of each rank
carry meaningful bytes); rank 0's tokens are the answer, the others acknowledge.

A checkpoint runs on the array path (NumPy or CuPy) or, with --model-backend torch (the default
on a GPU where torch and Triton are installed), on workers/model/torch_backend.py: the same
model with fused kernels, and on a GPU at --tp 1 its decode steps captured as CUDA graphs at
start-up, inside the launcher's wait for ready.
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
from kvrt.workers.kv_pool import attach_pools
from kvrt.workers.model.transformer import Model, ModelShape, SeqInput
from kvrt.workers.progress import Progress, ProgressBeat
from kvrt.workers.model.prompt_logprobs import PromptQuery
from kvrt.workers.model.sampler import SamplingRows, sample, top_logprobs
from kvrt.workers.model.threads import BlasThreads, usable_cores

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
        started = time.monotonic()
        allreduce = self.allreduce.sum if self.allreduce else None
        if cfg.model_dir and cfg.model_backend == "torch":
            from kvrt.workers.model.torch_backend import TorchModel  # torch only where this backend is asked for

            device = f"cuda:{self.xp.cuda.runtime.getDevice()}" if cfg.device == "cuda" else "cpu"
            self.model = TorchModel.load(cfg.model_dir, cfg.model_fingerprint, cfg.max_model_len, device, cfg.kv_dtype,
                                         cfg.compute_dtype, child.rank, cfg.tp, allreduce, self.xp)
        elif cfg.model_dir:
            from kvrt.workers.model.hf_model import HFModel  # checkpoint reading only where one is served

            self.model = HFModel.load(cfg.model_dir, cfg.model_fingerprint, cfg.max_model_len, self.xp,
                                      kv_dtype=cfg.kv_dtype, rank=child.rank, tp=cfg.tp, allreduce=allreduce,
                                      matmul_dtype=cfg.compute_dtype)
        else:
            self.model = Model(ModelShape.from_config(cfg), self.xp, kv_dtype=cfg.kv_dtype)
        if self.model.shape.windows != tuple(cfg.layer_windows or (0,) * cfg.num_layers):
            raise RuntimeError(f"the model's layer windows {self.model.shape.windows} are not the node's "
                               f"{cfg.layer_windows} (its pool's layer groups)")
        if cfg.device == "cuda":  # kernels compiled now, before ready, not in the first steps
            t0 = time.monotonic()
            self.model.warm_up(cfg.block_size)
            warm_up_sampling(self.xp, cfg.vocab_size)
            log.info("warm-up steps (kernels compiled) in %.1f s", time.monotonic() - t0)
            if cfg.model_backend == "torch":
                self._capture_graphs(cfg, started)
        self.block_size = cfg.block_size
        self.side_groups = len(cfg.kv_groups.windows) - 1  # layer groups with tables of their own
        self.vocab_size = cfg.vocab_size  # the logits' width: what a guided mask covers
        self.owners = Signal.attach(child.reg, P.OWNERS_DEVICE).array if cfg.check_ownership else None
        me, topo = (P.ROLE_WORKER, child.rank), Topology.of(cfg)
        [self.orders], [self.answers] = topo.receivers(child.reg, me), topo.senders(child.reg, me)
        self.progress = Progress()
        self.model.beat = self.progress.mark  # the model marks its progress; the helper beats for it
        self.beater = ProgressBeat(self.progress, self._beat, beat_period(cfg.hang_timeout),
                                   cfg.hang_timeout).start()

    def _beat(self) -> None:
        """The helper thread's beat: the heartbeat (the launcher's hang watch) and the marks so
        far (the engine's bound on the step in flight: runtime/engine/step_runner.py)."""
        member = self.child.member
        member.beat()
        member.progressed(self.progress.marks)

    def _capture_graphs(self, cfg, started: float) -> None:
        """Decode graphs over this rank's pool (tp 1 only: workers/model/graphs.py), within what
        is left of half the node's --ready-timeout: start-up stays inside the launcher's wait,
        and batches a cut-short capture did not reach run eager."""
        max_batch = cfg.max_num_seqs if cfg.cuda_graph_max_batch < 0 else cfg.cuda_graph_max_batch
        if cfg.tp > 1 or max_batch == 0:
            log.info("decode steps run eager (%s)", "--tp > 1: the all-reduce cannot be captured" if cfg.tp > 1
                     else "--cuda-graph-max-batch 0")
            return
        budget = max(1.0, cfg.ready_timeout / 2 - (time.monotonic() - started))
        self.model.capture_graphs(self.device.array, max_batch, budget, beat=self.child.beat)

    def serve(self) -> int:
        log.info("serving %s: %d device blocks, model %s, ownership checks %s", self.orders.name,
                 self.device.num_blocks, self.model.shape, "on" if self.owners is not None else "off")
        self.child.set_ready()
        return self.child.serve_orders(self.orders, self.answers, {P.StepBatch: self.run_step})

    def run_step(self, step: P.StepBatch) -> P.StepResult:
        """Compute one step; any failure becomes an error answer, never an exit."""
        t0 = time.perf_counter()
        self.progress.begin(step.step_id)
        self.child.member.in_step(step.step_id)
        try:
            return self._run_step(step, t0)
        finally:
            self.progress.end()
            self.child.member.in_step(-1)

    def _run_step(self, step: P.StepBatch, t0: float) -> P.StepResult:
        try:
            seqs = self._inputs(step)
            if self.owners is not None:
                self._check_owned(step.step_id, seqs)
            rows = self._sampling(step)
            query = self._prompt_query(step) if self.child.rank == 0 else None
            rows.allowed_rows, rows.allowed = _guided(step, len(step.query_lens), self.vocab_size)
            with self.threads.for_rows(len(step.tokens)):
                logits, scores = self.model.step_outputs(self.device.array, seqs, query, on_device=True)
                if self.child.rank == 0:  # on the device: only the tokens and logprobs come back
                    top_ids, top_lps = top_logprobs(logits, rows, self.xp)
                    tokens, logprobs = sample(logits, rows, self.xp)
        except (ValueError, OwnershipError) as e:
            log.error("step %d failed: %s", step.step_id, e)
            return P.StepResult(step.step_id, self.child.rank, _NO_TOKENS, time.perf_counter() - t0,
                                f"worker[{self.child.rank}] step {step.step_id}: {e}")
        if self.child.rank != 0:
            return P.StepResult(step.step_id, self.child.rank, _NO_TOKENS, time.perf_counter() - t0)
        ks = rows.top_logprobs if rows.top_logprobs is not None else np.zeros(len(tokens), np.int64)
        keep = np.arange(top_ids.shape[1])[None, :] < ks[:, None]  # each row's own count, in row order
        res = P.StepResult(step.step_id, self.child.rank, tokens, time.perf_counter() - t0,
                           logprobs=logprobs.tolist() if rows.logprobs.any() else [],
                           top_ids=top_ids[keep].astype(np.int32), top_logprobs=top_lps[keep].tolist())
        if scores is not None:
            res.prompt_logprobs, res.prompt_ranks = scores.logprobs.tolist(), scores.ranks.astype(np.int32)
            res.prompt_top_ids, res.prompt_top_logprobs = scores.top_ids, scores.top_logprobs.tolist()
        return res

    def _inputs(self, step: P.StepBatch) -> list[SeqInput]:
        n = len(step.query_lens)
        if not (len(step.starts) == len(step.table_lens) == n and int(step.query_lens.sum()) == len(step.tokens)
                and int(step.table_lens.sum()) == len(step.tables)):
            raise ValueError("step batch fields do not agree in length")
        q_off = np.concatenate([[0], np.cumsum(step.query_lens)])
        t_off = np.concatenate([[0], np.cumsum(step.table_lens)])
        k = self.side_groups
        if len(step.group_tables) != k * len(step.tables):
            raise ValueError(f"step batch has {len(step.group_tables)} group table entries; {k} more layer "
                             f"group(s) of {len(step.tables)} need {k * len(step.tables)}")
        return [SeqInput(step.tokens[q_off[i]:q_off[i + 1]], int(step.starts[i]), step.tables[t_off[i]:t_off[i + 1]],
                         tuple(step.group_tables[k * t_off[i] + g * (t_off[i + 1] - t_off[i]):
                                                 k * t_off[i] + (g + 1) * (t_off[i + 1] - t_off[i])] for g in range(k)))
                for i in range(n)]

    @staticmethod
    def _prompt_query(step: P.StepBatch) -> PromptQuery | None:
        """The prompt rows the batch asks to score (None: no sequence asks): sequence i's first
        prompt_rows[i] rows, each with its target and the sequence's prompt_top[i]."""
        if not len(step.prompt_rows) and not len(step.prompt_targets) and not len(step.prompt_top):
            return None
        n = len(step.query_lens)
        counts, ks = step.prompt_rows.astype(np.int64), step.prompt_top.astype(np.int64)
        if len(counts) != n or len(ks) != n or int(counts.sum()) != len(step.prompt_targets):
            raise ValueError(f"step batch prompt logprob fields do not have one entry for each of its {n} "
                             "sequences, or their targets do not add up")
        if np.any(counts < 0) or np.any(counts > step.query_lens) or np.any((ks < 0) | (ks > 64)):
            raise ValueError("step batch prompt logprob rows or alternatives out of range")
        first = np.concatenate([[0], np.cumsum(step.query_lens.astype(np.int64))[:-1]])
        rows = np.repeat(first, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        return PromptQuery(rows, step.prompt_targets.astype(np.int64), np.repeat(ks, counts))

    @staticmethod
    def _sampling(step: P.StepBatch) -> SamplingRows:
        """The batch's per-sequence sampling parameters (none at all: every sequence greedy);
        each sampled token's position is where its sequence's step ends."""
        n = len(step.query_lens)
        fields = (step.temperature, step.top_p, step.top_k, step.seed, step.logprobs)
        if all(len(f) == 0 for f in fields):
            return SamplingRows.greedy(n)
        per_seq = (step.min_p, step.top_logprobs, step.bias_lens, step.repetition, step.presence, step.frequency,
                   step.pen_lens)
        if any(len(f) != n for f in fields) or any(len(f) not in (0, n) for f in per_seq):
            raise ValueError(f"step batch sampling fields do not have one entry for each of its {n} sequences")
        pens = (step.repetition, step.presence, step.frequency, step.pen_lens)
        if len({len(f) for f in pens}) != 1:
            raise ValueError("step batch penalty fields come together")

        def opt(a, dtype):
            return np.asarray(a, dtype) if len(a) else None

        try:
            rows = SamplingRows(np.asarray(step.temperature, np.float64), np.asarray(step.top_p, np.float64),
                                np.asarray(step.top_k, np.int64), np.asarray(step.seed, np.uint64),
                                step.starts.astype(np.int64) + step.query_lens, np.asarray(step.logprobs) != 0,
                                opt(step.min_p, np.float64), opt(step.top_logprobs, np.int64),
                                opt(step.bias_lens, np.int64), np.asarray(step.bias_ids, np.int64),
                                np.asarray(step.bias_vals, np.float64), opt(step.repetition, np.float64),
                                opt(step.presence, np.float64), opt(step.frequency, np.float64),
                                opt(step.pen_lens, np.int64), np.asarray(step.pen_ids, np.int64),
                                np.asarray(step.pen_counts, np.int64))
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"step batch sampling fields: {e}") from None
        if not (np.all(rows.temperature >= 0) and np.all((rows.top_p > 0) & (rows.top_p <= 1))
                and np.all(rows.top_k >= 0) and np.all((rows.min_p >= 0) & (rows.min_p <= 1))):
            raise ValueError("step batch sampling fields out of range")
        _check_entries(rows.bias_lens, rows.bias_ids, len(rows.bias_vals), "bias")
        _check_entries(rows.pen_lens, rows.pen_ids, len(rows.pen_counts), "penalty")
        if rows.top_logprobs is not None and not np.all((rows.top_logprobs >= 0) & (rows.top_logprobs <= 64)):
            raise ValueError("step batch top_logprobs out of range")
        if rows.repetition is not None and not np.all(rows.repetition > 0):
            raise ValueError("step batch repetition penalties must be positive")
        return rows

    def _check_owned(self, step_id: int, seqs: list[SeqInput]) -> None:
        """Debug mode: blocks this step writes must be the worker's; blocks it reads must hold
        written KV (the worker's own, or the prefix cache's, possibly being copied out)."""
        bs = self.block_size
        what = f"step {step_id} on worker[{self.child.rank}]"
        for s in seqs:
            first = s.start // bs
            for table in (s.block_table, *s.group_tables):
                reads = table[:first]
                check_owners(self.owners, table[first:], "device", what, P.OWNER_WORKER)
                check_owners(self.owners, reads[reads >= 0], "device", what,
                             (P.OWNER_WORKER, P.OWNER_CACHE, P.OWNER_TRANSFER))

    def close(self) -> None:
        self.beater.close()
        self.answers.close()
        self.orders.detach()
        if self.allreduce is not None:
            self.allreduce.close()
        for pool in (self.device, self.host):
            if pool is not None:
                pool.close()


def warm_up_sampling(xp, vocab: int) -> None:
    """Greedy and sampled draws and top logprobs over dummy logits, results dropped: on a GPU the
    sampler's CuPy kernels compile at their first call, which must not be a serving step's."""
    logits = xp.zeros((2, vocab), dtype=xp.float32)
    sampled = SamplingRows(np.ones(2), np.full(2, 0.9), np.full(2, 50, np.int64), np.arange(2, dtype=np.uint64),
                           np.ones(2, np.int64), np.ones(2, bool), top_logprobs=np.full(2, 5, np.int64))
    for rows in (SamplingRows.greedy(2), sampled):
        top_logprobs(logits, rows, xp)
        sample(logits, rows, xp)


def beat_period(hang_timeout: float) -> float:
    """How often the helper looks at the main thread's progress: several looks per hang timeout,
    so one look that finds no progress (the main thread between two marks and descheduled)
    is not all the launcher sees."""
    return min(0.25, hang_timeout / 8) if hang_timeout > 0 else 0.25


def _guided(step: P.StepBatch, n: int, vocab: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The guided rows and their masks [g, words] (None, None: no row guided); ValueError when
    they do not fit the batch or a mask allows no token (a token outside it would be garbage)."""
    g = len(step.guided_rows)
    if g == 0 and len(step.guided_mask) == 0:
        return None, None
    words = -(-vocab // 32)
    rows = np.asarray(step.guided_rows, np.int64)
    if len(step.guided_mask) != g * words or not np.all((rows >= 0) & (rows < n)) or len(np.unique(rows)) != g:
        raise ValueError(f"step batch guided masks: {g} rows of {n} and {len(step.guided_mask)} words "
                         f"({words} a row for a vocabulary of {vocab})")
    mask = np.asarray(step.guided_mask, np.int32).reshape(g, words)
    if not mask.any(axis=-1).all():
        raise ValueError("step batch guided masks: a row allows no token")
    return rows, mask


def _check_entries(lens: np.ndarray | None, ids: np.ndarray, values: int, what: str) -> None:
    """(row, token) entries agree with their row counts and name tokens at most once per row
    (a repeated token would be scattered twice, once lost). The ids' range is the model's to
    check (an index past the vocabulary fails the step)."""
    total = 0 if lens is None else int(lens.sum())
    if (lens is not None and np.any(lens < 0)) or total != len(ids) or values != len(ids):
        raise ValueError(f"step batch {what} entries do not agree with their counts")
    if total:
        rows = np.repeat(np.arange(len(lens)), lens)
        if np.any(ids < 0) or len(np.unique(rows * (int(ids.max()) + 1) + ids)) != total:
            raise ValueError(f"step batch {what} entries name a token twice in a row, or a negative one")


def main(argv: list[str] | None = None) -> int:
    return run_child(P.ROLE_WORKER, Worker, argv)


if __name__ == "__main__":
    sys.exit(main())
