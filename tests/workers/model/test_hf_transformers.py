"""kvrt and its float64 reference against transformers' own PyTorch models, for every
architecture case of tests/hfkit.py (skipped without torch: the CI suite has none and relies on
the float64 reference, which this file checks against transformers where torch is installed).

- The reference: on checkpoints tests/hfkit.py writes, its logits equal transformers' forward
  pass in float64 (eager attention, eager experts) to 1e-5 of the largest logit (transformers
  computes RoPE's angles in float32, ~1e-7).
- kvrt: on checkpoints transformers writes itself (`save_pretrained` of a model transformers
  built from its config, its weights redrawn at scales that spread the logits over several
  units), F32 and BF16 files: the paged forward (a prompt in uneven chunks, then decode steps)
  equals transformers' float32 forward to 1e-4 of the largest logit, and kvrt's greedy tokens
  equal `generate`'s, which runs transformers' own KV cache (its sliding-window layers
  included); a token may differ only where transformers' own top two logits are within 1e-3,
  and none did when this was written.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.transformer import SeqInput
from tests.hfkit import (ARCH_CASES, GEMMAS, VOCAB, case_config, dense_logits, grouped, hf_config, make_checkpoint,
                         paged_pool)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BS = 8
NEAR_TIE = 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend with the machine's other work
    yield
    torch.set_num_threads(before)


def load(path: str, dtype) -> "torch.nn.Module":
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_reference_equals_transformers(tmp_path, case):
    arch, cfg = case_config(case, tied=arch_is_gemma(case))
    ck = make_checkpoint(tmp_path, arch, dtype="F32", config=cfg, seed=4)
    toks = np.random.default_rng(0).integers(0, VOCAB, 40)
    with torch.no_grad():
        want = load(ck.path, torch.float64)(torch.tensor(toks)[None]).logits[0].numpy()
    got = dense_logits(ck, toks)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def arch_is_gemma(case: str) -> bool:
    return ARCH_CASES[case][0] in GEMMAS


def transformers_checkpoint(path: str, case: str, file_dtype: str, seed: int = 0) -> "torch.nn.Module":
    """A checkpoint transformers writes: its model of the case's config, weights redrawn (its own
    initialisation leaves logits within a hair of each other: every greedy token a near-tie),
    saved by save_pretrained in `file_dtype`. Returns the float32 model of the saved file's
    values, as transformers computes at that dtype (Gemma's embedding scale is cast to it)."""
    arch, cfg = case_config(case, tied=arch_is_gemma(case))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32,
                                                          attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_()
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif p.ndim == 1:  # norms: Gemma's are applied as 1 + w
                p.normal_(0.0 if arch in GEMMAS else 1.0, 0.1)
            else:  # [out, in] projections, and experts' [count, out, in]: scaled by their fan-in
                scale = 4.0 if name == "lm_head.weight" else 2.0 if ("q_proj" in name or "qkv" in name or
                                                                   name.endswith("mlp.gate.weight")) else 1.0
                p.normal_(0.0, scale / p.shape[-1] ** 0.5)
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[file_dtype]
    model.to(dtype).save_pretrained(path)
    saved = load(path, torch.float32)
    if arch in GEMMAS and file_dtype == "BF16":
        embed = saved.model.embed_tokens
        embed.embed_scale.fill_(embed.embed_scale.to(torch.bfloat16).float())
    return saved


def hf_logits(model, toks) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks, dtype=np.int64))[None]).logits[0].double().numpy()


@pytest.mark.parametrize("file_dtype", ["F32", "BF16"])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_kvrt_equals_transformers_on_its_checkpoints(tmp_path, case, file_dtype):
    hf = transformers_checkpoint(str(tmp_path), case, file_dtype)
    model = HFModel(inspect(str(tmp_path)), 512)
    rng = np.random.default_rng(1)
    # logits: a prompt in uneven chunks, then decode steps
    toks = rng.integers(0, VOCAB, 47).astype(np.int32)
    want = hf_logits(hf, toks)
    pool = paged_pool(model, 16, BS)
    table = np.arange(1, 8, dtype=np.int32)
    pos = 0
    for n in (13, 8, 20, 1, 1, 1, 1, 1, 1):
        got = model.step_logits(pool, grouped(model, [SeqInput(toks[pos:pos + n], pos, table)], 16))[0]
        pos += n
        assert np.abs(got - want[pos - 1]).max() <= 1e-4 * np.abs(want[pos - 1]).max(), pos
    # greedy tokens: transformers' generate, with its own cache
    new = 10
    for length in (9, 30, 70):
        prompt = rng.integers(0, VOCAB, length).astype(np.int32)
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompt[None].astype(np.int64)), max_new_tokens=new, do_sample=False,
                              min_new_tokens=new, pad_token_id=0)[0, length:].tolist()
        got = greedy_paged(model, prompt, new)
        if got != out:
            i = next(j for j, (a, b) in enumerate(zip(got, out)) if a != b)
            top2 = np.sort(hf_logits(hf, np.concatenate([prompt, out[:i]]))[-1])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"{case}: token {i} differs: kvrt {got}, transformers {out}"


def greedy_paged(model: HFModel, prompt: np.ndarray, new: int) -> list[int]:
    pool = paged_pool(model, 16, BS)
    table = np.arange(16, dtype=np.int32)
    out = [int(model.step(pool, grouped(model, [SeqInput(prompt, 0, table)], 16))[0])]
    while len(out) < new:
        seq = SeqInput(np.array(out[-1:], np.int32), len(prompt) + len(out) - 1, table)
        out.append(int(model.step(pool, grouped(model, [seq], 16))[0]))
    return out
