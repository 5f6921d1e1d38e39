"""The torch backend on a GPU (skipped without CUDA; run by .ci/gpu): real CUDA graphs, compiled
Triton kernels, float16 and real bfloat16.

- decode steps replayed as CUDA graphs give the float64 reference's greedy tokens, batched,
  with sequences joining and finishing (the batch moving between buckets), in float16 and
  bfloat16, and the logits the eager steps give;
- nodes with --model-backend torch at --tp 1 (graphs) and --tp 2 (eager, the all-reduce over
  CUDA IPC between torch tensors) serve the reference's tokens;
- a node whose Triton and CuPy kernel caches are empty compiles at warm-up and serves its first
  requests within their deadlines.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.gpukit import cuda_cupy
from tests.hfkit import VOCAB, dense_logits, greedy, make_checkpoint
from tests.launched import launched
from tests.runtime.engine.test_oracle import run_all, tokens
from tests.workers.model.test_hf_oracle import OPTS, checkpoint, expected, prompts  # noqa: F401 (fixtures)
from tests.workers.model.test_torch_backend import TOL, torch_model

cupy = cuda_cupy()
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvrt.workers.model.transformer import SeqInput  # noqa: E402


def greedy_batch(model, prompts: list[np.ndarray], news: list[int], bs: int = 8) -> list[list[int]]:
    """Greedy decoding of several sequences: each prompt prefilled alone, then every unfinished
    sequence decoded together, one token a step (the batch shrinks as sequences finish)."""
    per = 16
    pool = cupy.zeros(model.shape.kv_layout(bs, model.kv_dtype.name).pool_shape(per * len(prompts)),
                      dtype=model.kv_dtype)
    tables = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in range(len(prompts))]
    model.capture_graphs(pool, 8, math.inf)
    outs = [[int(model.step(pool, [SeqInput(p, 0, t)])[0])] for p, t in zip(prompts, tables)]
    while True:
        live = [i for i in range(len(prompts)) if len(outs[i]) < news[i]]
        if not live:
            return outs
        seqs = [SeqInput(np.array([outs[i][-1]], np.int32), len(prompts[i]) + len(outs[i]) - 1, tables[i])
                for i in live]
        for i, tok in zip(live, model.step(pool, seqs)):
            outs[i].append(int(tok))


def near_tie(ck, prompt, want: list[int], got: list[int], tol: float) -> bool:
    """Whether the first disagreement is at a top-2 gap within `tol` of the reference's logits."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = dense_logits(ck, np.concatenate([prompt, want[:i]]))[-1]
    top2 = np.sort(logits)[-2:]
    return (top2[1] - top2[0]) / np.abs(logits).max() <= tol


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_graph_replays_give_the_reference_tokens(tmp_path, arch, compute):
    ck = make_checkpoint(tmp_path, arch, dtype="BF16", seed=3)
    model = torch_model(ck, compute, "triton")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(3, 40))).astype(np.int32) for _ in range(6)]
    news = [12, 5, 9, 12, 2, 7]
    got = greedy_batch(model, prompts, news)
    assert model.graphs.replays > 0
    for p, n, g in zip(prompts, news, got):
        want = greedy(ck, p, n)
        assert g == want or near_tie(ck, p, want, g, TOL[compute]), (g, want)


@pytest.mark.parametrize("compute", ["float16", "bfloat16", "float32"])
def test_a_replay_gives_the_eager_steps_logits(tmp_path, compute):
    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16")
    model = torch_model(ck, compute, "triton")
    pool = cupy.zeros(model.shape.kv_layout(8, model.kv_dtype.name).pool_shape(64), dtype=model.kv_dtype)
    model.capture_graphs(pool, 8, math.inf)
    tables = [np.arange(i * 8, (i + 1) * 8, dtype=np.int32) for i in range(5)]
    for i, t in enumerate(tables):
        model.step(pool, [SeqInput(np.arange(3 + 7 * i, dtype=np.int32) % VOCAB, 0, t)])
    seqs = [SeqInput(np.array([i + 1], np.int32), 3 + 7 * i, t) for i, t in enumerate(tables)]
    before = model.graphs.replays
    eager = model.step_outputs(pool, seqs, graphs=False)[0]
    replayed = model.step_outputs(pool, seqs)[0]  # the same slots written again: the same K/V
    assert model.graphs.replays == before + 1
    assert np.allclose(replayed, eager, rtol=1e-3, atol=1e-3 * np.abs(eager).max())


@pytest.mark.e2e
@pytest.mark.parametrize("tp, compute", [(1, "float16"), (1, "bfloat16"), (2, "float16"), (2, "bfloat16")])
def test_a_cuda_node_on_the_torch_backend_serves_the_reference(node, tmp_path, checkpoint, prompts, expected,
                                                              tp, compute):
    opts = (*OPTS, "--device", "cuda", "--model", checkpoint.path, "--model-backend", "torch", "--tp", str(tp),
            "--compute-dtype", compute, "--num-gpu-blocks", "48", "--num-cpu-blocks", "64",
            "--max-num-batched-tokens", "64")
    with launched(node, tmp_path, *opts, env={"KVRT_CHECK_OWNERSHIP": "1"}, ready_s=180) as ln:
        assert tokens(run_all(ln.client, prompts)) == expected, ln.logs()
        assert tokens(run_all(ln.client, prompts, concurrent=False)) == expected, ln.logs()
        stats = ln.idle_stats()
        assert stats["tasks_done"] > 0 and stats["tasks_failed"] == 0 and stats["device_used"] == 0
        if tp == 1:
            assert "captured" in ln.logs()


@pytest.mark.e2e
def test_empty_kernel_caches_do_not_fail_the_first_requests(node, tmp_path, checkpoint, prompts, expected):
    """Triton compiles each kernel variant at its first use and CuPy each sampler kernel: with
    both caches empty (a fresh machine) the worker compiles them while warming up, before it
    says ready, and graph capture runs there too; the first requests are then served within the
    default step deadline and hang timeout."""
    opts = (*OPTS, "--device", "cuda", "--model", checkpoint.path, "--model-backend", "torch",
            "--num-gpu-blocks", "48")
    env = {"CUPY_CACHE_DIR": str(tmp_path / "cupy"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    with launched(node, tmp_path, *opts, env=env, ready_s=180) as ln:
        assert tokens(run_all(ln.client, prompts[:2], concurrent=False)) == expected[:2], ln.logs()
