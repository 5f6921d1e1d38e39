"""The torch backend (workers/model/torch_backend.py) against the independent dense float64
reference of tiny checkpoints (tests/hfkit.py): every architecture, float32, float16 and
bfloat16 compute, with both op sets (plain torch, and the Triton kernels: compiled on a GPU,
under Triton's interpreter on a CPU), over a prompt prefilled in uneven chunks, decode steps, and
a second sequence sharing its first blocks batched beside a decode row; greedy decoding gives
the reference's tokens. Skipped without torch (the default CPU suite); the kernels lane and the
GPU script run it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.hfkit import VOCAB, dense_logits, greedy, make_checkpoint
from tests.torchkit import torch_device
from tests.workers.model.test_hf_dtype import ARCHS, BS, F16_TOL, expected, run_paged, within
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.prompt_logprobs import PromptQuery
from kvrt.workers.model.transformer import SeqInput

torch, DEVICE = torch_device()

from kvrt.workers.model.torch_backend import TorchModel, host_dtype  # noqa: E402
from kvrt.workers.model.torch_ops import TorchOps  # noqa: E402

U_BF16 = 2.0 ** -8
# bfloat16 keeps 8 bits where float16 keeps 11: the same argument as F16_TOL's at its unit
BF16_TOL = 8 * U_BF16
TOL = {"float32": 1e-4, "float16": F16_TOL, "bfloat16": BF16_TOL}


def ops_for(name: str):
    if name == "torch":
        return TorchOps()
    from tests.torchkit import triton_device

    triton_device()  # skips where Triton cannot run
    from kvrt.workers.model.torch_ops import TritonOps

    return TritonOps()


def torch_model(ck, compute: str, ops: str = "torch", max_len: int = 512) -> TorchModel:
    kv = "float32" if compute == "float32" else "float16"
    hf = HFModel(inspect(ck.path), max_len, np, kv_dtype=kv, matmul_dtype=host_dtype(compute))
    xp = np
    if DEVICE == "cuda":
        import cupy as xp  # the worker's module on a GPU: the pool is a CuPy array
    return TorchModel(hf, DEVICE, compute, ops=ops_for(ops), xp=xp)


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def check_logits(model: TorchModel, ck, tol: float) -> None:
    chunks = (13, 8, 1, 1, 20)
    toks = np.random.default_rng(1).integers(0, VOCAB, sum(chunks)).astype(np.int32)
    for got, want in zip(run_paged(model, toks, chunks, model.xp), expected(ck, toks, chunks)):
        within(host(got), want, tol)


@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_plain_torch_ops_match_dense_float64(tmp_path, arch, compute):
    ck = make_checkpoint(tmp_path, arch, dtype="BF16", tied=arch == "Qwen3ForCausalLM")
    check_logits(torch_model(ck, compute), ck, TOL[compute])


@pytest.mark.parametrize("compute", ["float32", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_triton_kernels_match_dense_float64(tmp_path, arch, compute):
    ck = make_checkpoint(tmp_path, arch, dtype="BF16", tied=arch == "Qwen3ForCausalLM")
    check_logits(torch_model(ck, compute, "triton"), ck, TOL[compute])


def greedy_paged(model, prompt: np.ndarray, new: int) -> list[int]:
    pool = model.xp.zeros(model.shape.kv_layout(BS, model.kv_dtype.name).pool_shape(16), dtype=model.kv_dtype)
    table = np.arange(16, dtype=np.int32)
    out = [int(model.step(pool, [SeqInput(prompt, 0, table)])[0])]
    while len(out) < new:
        seq = SeqInput(np.array([out[-1]], np.int32), len(prompt) + len(out) - 1, table)
        out.append(int(model.step(pool, [seq])[0]))
    return out


def check_greedy(model, ck, tol: float) -> None:
    """The reference's greedy tokens, a flip forgiven only at a near-tie (a top-2 gap within
    the tolerance, where the reference's own choice hangs on its last bits)."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        prompt = rng.integers(0, VOCAB, int(rng.integers(5, 30))).astype(np.int32)
        want, got = greedy(ck, prompt, 12), greedy_paged(model, prompt, 12)
        if got == want:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        logits = dense_logits(ck, np.concatenate([prompt, want[:i]]))[-1]
        top2 = np.sort(logits)[-2:]
        assert (top2[1] - top2[0]) / np.abs(logits).max() <= tol, f"token {i}: {got} != {want}"


@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_the_reference(tmp_path, arch, compute):
    ck = make_checkpoint(tmp_path, arch, dtype="BF16", seed=3)
    check_greedy(torch_model(ck, compute), ck, TOL[compute])


def test_weights_live_once_on_torch(tmp_path):
    """The model's host copies are handed over: every projection one torch tensor in the
    compute dtype, [out, in]; a tied LM head is the embedding itself."""
    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", tied=True)
    model = torch_model(ck, "bfloat16")
    w = model.layers[0]
    assert {t.dtype for t in (model.embed, w.wqkv, w.wo, w.w_gate_up, w.w_down)} == {torch.bfloat16}
    assert {t.dtype for t in (w.attn_norm, w.bqkv, model.final_norm)} == {torch.float32}
    assert model.lm_head is model.embed and model.model.lm_head is None
    assert tuple(w.wo.shape) == (32, 32) and tuple(w.w_gate_up.shape) == (128, 32)


def test_prompt_scores_match_the_array_path(tmp_path):
    """Prompt logprobs from the torch backend's hidden states equal the array path's (float32)."""
    ck = make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32")
    ref = HFModel(inspect(ck.path), 512, np, kv_dtype="float32")
    model = torch_model(ck, "float32")
    toks = np.random.default_rng(2).integers(0, VOCAB, 20).astype(np.int32)
    seqs = [SeqInput(toks, 0, np.arange(3, dtype=np.int32))]
    query = PromptQuery(np.arange(19, dtype=np.int64), toks[1:].astype(np.int64), np.full(19, 3, np.int64))
    pools = [xp.zeros(ref.shape.kv_layout(BS, "float32").pool_shape(4), np.float32) for xp in (np, model.xp)]
    want = ref.step_outputs(pools[0], seqs, query)[1]
    got = model.step_outputs(pools[1], seqs, query)[1]
    assert np.allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert np.array_equal(got.ranks, want.ranks) and np.array_equal(got.top_ids, want.top_ids)


def test_a_bad_batch_is_refused_as_the_array_path_refuses_it(tmp_path):
    model = torch_model(make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32"), "float32")
    pool = model.xp.zeros(model.shape.kv_layout(BS, "float32").pool_shape(4), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        model.step(pool, [SeqInput(np.array([VOCAB], np.int32), 0, np.arange(1, dtype=np.int32))])
    with pytest.raises(ValueError, match="block_table"):
        model.step(pool, [SeqInput(np.arange(20, dtype=np.int32), 0, np.arange(2, dtype=np.int32))])


def test_the_op_set_follows_the_device():
    """Triton on any CUDA device (cuda, cuda:1: a rank's), plain torch on a CPU unless asked."""
    from kvrt.workers.model.torch_ops import pick_ops

    assert pick_ops("cpu").name == "torch" and pick_ops("cuda:0", "torch").name == "torch"
    pytest.importorskip("triton")
    assert pick_ops("cuda").name == pick_ops("cuda:1").name == pick_ops("cpu", "triton").name == "triton"


def test_warm_up_runs_every_kind_of_step(tmp_path):
    """Prefill tiles of 64 and 16 rows, decode rows, mixed batches, prompt scoring: the steps the
    warm-up takes (what a GPU compiles before the worker says ready); none leaves a pool view."""
    model = torch_model(make_checkpoint(tmp_path, "Qwen3ForCausalLM", dtype="BF16"), "float32")
    seen = []
    real = model.step_outputs

    def spy(pool, seqs, prompt=None, on_device=False, graphs=True):
        seen.append(([len(q.tokens) for q in seqs], prompt is not None))
        return real(pool, seqs, prompt, on_device, graphs)

    model.step_outputs = spy
    sums = []
    model.model.allreduce = lambda a: sums.append(1) or a  # a rank of --tp 2: no sum while warming up
    model.warm_up(BS)
    assert sums == [] and model.model.allreduce is not None
    assert {max(n) for n, _ in seen} >= {40, 2, 1} and ([1, 40], True) in seen and ([1, 1], False) in seen
    assert model._pools == {}


def test_a_layer_it_does_not_implement_is_refused(tmp_path):
    """An architecture, or a layer weight, the torch layer would ignore is refused at load, never
    run with a part of its layer missing; `auto` then keeps the array path."""
    from kvrt.workers.model.backends import resolve_backend

    ck = make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32")
    hf = HFModel(inspect(ck.path), 512, np, kv_dtype="float32")
    with pytest.raises(ValueError, match="float64"):
        TorchModel(HFModel(inspect(ck.path), 512, np, kv_dtype="float64"), DEVICE, "float32", ops=TorchOps())
    hf.layers[1].sliding_window_norm = np.ones(4, np.float32)  # a weight some later architecture has
    with pytest.raises(ValueError, match="sliding_window_norm"):
        TorchModel(hf, DEVICE, "float32", ops=TorchOps())
    llama = hf.config
    hf.config = type(llama)(**{**vars(llama), "arch": "MistralForCausalLM"})
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        TorchModel(hf, DEVICE, "float32", ops=TorchOps())
    assert resolve_backend("auto", "cuda", hf.config) == "array"
    assert resolve_backend("auto", "cpu", llama) == "array"
    with pytest.raises(ValueError, match="array"):
        resolve_backend("torch", "cuda", hf.config)
    # an implemented architecture whose config turns on a switch the torch layer lacks (Qwen2's
    # use_sliding_window, say) is refused by name too, and auto keeps the array path
    windowed = type(llama)(**{**vars(llama), "features": replace(llama.features, windows=(0, 8) * (llama.num_layers // 2))})
    with pytest.raises(ValueError, match="sliding-window"):
        resolve_backend("torch", "cuda", windowed)
    assert resolve_backend("auto", "cuda", windowed) == "array"


def test_fp8_blocks_and_layer_groups_are_refused_by_name(tmp_path):
    """FP8 e4m3 blocks (--kv-cache-dtype fp8) and a pool of layer groups (a model's sliding and
    full layers on pages of their own) are the array path's: the torch layer stores and reads
    K/V as they are, over one block table, so it refuses both by name at load, and the launcher
    (`torch_problem`) refuses FP8 before any process starts while auto keeps the array path."""
    from kvrt.ipc.layout import FP8_E4M3
    from kvrt.workers.model.backends import resolve_backend

    ck = make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32")
    with pytest.raises(ValueError, match="not float8_e4m3fn.*--model-backend array"):
        TorchModel(HFModel(inspect(ck.path), 512, np, kv_dtype=FP8_E4M3), DEVICE, "float32", ops=TorchOps())
    hf = HFModel(inspect(ck.path), 512, np, kv_dtype="float32")
    hf.shape = replace(hf.shape, layer_windows=(0, 8))
    with pytest.raises(ValueError, match="sliding windows or layer groups"):
        TorchModel(hf, DEVICE, "float32", ops=TorchOps())
    with pytest.raises(ValueError, match="fp8"):
        resolve_backend("torch", "cuda", hf.config, "fp8")
    assert resolve_backend("auto", "cuda", hf.config, "fp8") == "array"
