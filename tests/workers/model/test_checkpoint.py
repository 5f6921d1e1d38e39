"""Checkpoint directories: what `inspect` accepts and refuses, RoPE read from config.json as
transformers reads it (each form, or refused naming the key), each architecture's features
read as transformers' config classes read them, the fingerprint block keys are rooted in, and
`kvrt launch --model` refusing a bad checkpoint or a contradicting shape flag with a clear
error before any process starts (nothing of the node in /dev/shm)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvrt.runtime.node.config import ConfigError, NodeConfig
from tests.conftest import REPO, leftovers
from tests.hfkit import (LLAMA3_SCALING, hf_config, make_checkpoint, reference_rope, transformers_config,
                         write_safetensors)
from kvrt.workers.model.checkpoint import CheckpointError, Weights, inspect


def edit_config(path, drop: tuple[str, ...] = (), **changes) -> dict:
    """Change config.json's top-level keys (removing those in `drop`); the new config."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return cfg


def test_safetensors_package_reads_what_the_test_writes(tmp_path):
    """The test's writer makes real safetensors files (the reference reader agrees)."""
    from safetensors.numpy import load_file

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_safetensors(str(tmp_path / "a.safetensors"), {"a": ("F32", a)})
    assert np.array_equal(load_file(str(tmp_path / "a.safetensors"))["a"], a)
    ck = make_checkpoint(tmp_path / "ck", "Qwen3ForCausalLM", dtype="F32")
    got = Weights(inspect(ck.path)).get("model.layers.1.self_attn.q_norm.weight")
    want = load_file(os.path.join(ck.path, "model.safetensors"))["model.layers.1.self_attn.q_norm.weight"]
    assert np.array_equal(got, want)


ALL_ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM",
             "Gemma3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM"]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_inspect_accepts_each_architecture(tmp_path, arch):
    info = inspect(make_checkpoint(tmp_path, arch, dtype="BF16", config=transformers_config(arch, tied=True)).path)
    assert info.config.arch == arch and info.config.tie_word_embeddings
    assert info.node_shape() == {"num_layers": 2, "num_kv_heads": 2, "vocab_size": 256, "max_model_len": 512,
                                 "head_dim": 16 if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                                            "Gemma3ForCausalLM") else 8}


# config.json changes -> the sliding window each layer has in transformers' modeling code
WINDOWS = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=24)),
    "mistral_null": ("MistralForCausalLM", dict(sliding_window=None)),
    "mistral_missing": ("MistralForCausalLM", dict(drop=("sliding_window",))),
    "qwen2_max_window_layers": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=24,
                                                         max_window_layers=1, drop=("layer_types",))),
    "qwen2_layer_types": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=24,
                                                   layer_types=["sliding_attention", "full_attention"])),
    "qwen2_off": ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=24, max_window_layers=0)),
    "qwen3": ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=24, max_window_layers=0,
                                       drop=("layer_types",))),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=24)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, sliding_window=24, max_window_layers=2,
                                              drop=("layer_types",))),
    "gemma2_default_pattern": ("Gemma2ForCausalLM", dict(sliding_window=24, drop=("layer_types",))),
    "gemma3_legacy_pattern": ("Gemma3ForCausalLM", dict(sliding_window=24, sliding_window_pattern=2,
                                                        drop=("layer_types",))),
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=24)),
}


@pytest.mark.parametrize("case", list(WINDOWS))
def test_windows_read_as_transformers_reads_them(tmp_path, case):
    """Each layer's window equals what transformers' modeling code applies for the same
    config.json (tests/hfkit.py's reading of its config object)."""
    from tests.hfkit import _windows

    arch, changes = WINDOWS[case]
    changes = dict(changes)
    drop = changes.pop("drop", ())
    ck = make_checkpoint(tmp_path, arch, config=transformers_config(arch))
    cfg = edit_config(ck.path, drop=drop, **changes)
    want = tuple(w or 0 for w in _windows(hf_config(cfg), arch))
    assert inspect(ck.path).config.features.windows == want


ARCH_REFUSED = {  # (architecture, config.json changes) -> words the error must hold
    "mixtral": ("LlamaForCausalLM", dict(architectures=["MixtralForCausalLM"]), "MixtralForCausalLM"),
    "gemma3_multimodal": ("Gemma3ForCausalLM", dict(architectures=["Gemma3ForConditionalGeneration"]),
                          "Gemma3ForConditionalGeneration"),
    "bidirectional": ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    "gemma_activation": ("Gemma2ForCausalLM", dict(hidden_activation="relu"), "hidden_activation 'relu'"),
    "llama_activation": ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    "sliding_without_window": ("Qwen2ForCausalLM", dict(use_sliding_window=False,
                                                        layer_types=["sliding_attention", "full_attention"]),
                               "use_sliding_window is false"),
    "layer_types_length": ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention"]), "layer_types must list"),
    "experts_disagree": ("Qwen3MoeForCausalLM", dict(num_experts=8), "num_experts and num_local_experts disagree"),
    "top_k_beyond": ("Qwen3MoeForCausalLM", dict(num_experts_per_tok=5), "num_experts_per_tok 5 exceeds"),
    "gemma3_flat_rope": ("Gemma3ForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                         "rope_parameters must map"),
    "gemma3_sliding_rope": ("Gemma3ForCausalLM", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4}}),
        "rope_parameters.sliding_attention.factor must be a positive number"),
    "qwen3_attention_bias": ("Qwen3ForCausalLM", dict(attention_bias=True), "attention_bias"),
}


@pytest.mark.parametrize("case", list(ARCH_REFUSED))
def test_unservable_architecture_refused_naming_the_key(tmp_path, case):
    arch, changes, words = ARCH_REFUSED[case]
    ck = make_checkpoint(tmp_path, arch, config=transformers_config(arch))
    edit_config(ck.path, **changes)
    with pytest.raises(CheckpointError, match="config.json: ") as e:
        inspect(ck.path)
    assert words in str(e.value)


def test_gemma3_ropes_read_as_transformers_reads_them(tmp_path):
    """Gemma 3's full and sliding layers' RoPEs, from transformers 5's per-layer-type
    rope_parameters and from transformers 4's rope_theta, rope_scaling and
    rope_local_base_freq."""
    ck = make_checkpoint(tmp_path, "Gemma3ForCausalLM", config=transformers_config(
        "Gemma3ForCausalLM", layer_types=["sliding_attention", "full_attention"]))
    forms = [
        ((), {}),
        ((), dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}})),
        (("rope_parameters",), dict(rope_theta=3e5, rope_local_base_freq=5e3,
                                    rope_scaling={"rope_type": "linear", "factor": 4.0})),
        (("rope_parameters",), {}),  # transformers' defaults: 1e6 and 1e4
    ]
    for drop, changes in forms:
        cfg = edit_config(ck.path, drop=drop, **changes)
        config = inspect(ck.path).config
        for layer, rope in enumerate(config.ropes()):
            want, factor = reference_rope(cfg, hf_config(cfg).layer_types[layer])
            np.testing.assert_allclose(rope.inv_freq(config.head_dim), want, rtol=1e-12)
            assert rope.attention_factor == factor


def test_longrope_is_served_within_its_original_context(tmp_path):
    """Beyond longrope's original context transformers switches new tokens to the long factors
    while cached keys keep the short ones: a node serves the positions before it, and says why."""
    ck = make_checkpoint(tmp_path, "Phi3ForCausalLM", config=transformers_config("Phi3ForCausalLM"))
    factors = [1.0 + i / 4 for i in range(4)]
    edit_config(ck.path, original_max_position_embeddings=64,
                rope_parameters={"rope_type": "su", "rope_theta": 1e4, "short_factor": factors, "long_factor": factors})
    info = inspect(ck.path)
    assert info.config.rope.rope_type == "longrope"  # Phi-3's legacy name, renamed as transformers renames it
    assert info.node_shape()["max_model_len"] == 64
    assert "longrope" in info.config.max_model_len()[1]


@pytest.mark.parametrize("width", ["moe_intermediate_size", "shared_expert_intermediate_size"])
def test_tp_must_split_each_expert_evenly(tmp_path, width):
    ck = make_checkpoint(tmp_path, "Qwen2MoeForCausalLM", config=transformers_config("Qwen2MoeForCausalLM"))
    inspect(ck.path).check_tp(2)
    cfg = edit_config(ck.path, **{width: 17})
    ck = make_checkpoint(tmp_path / "odd", config=cfg)
    with pytest.raises(CheckpointError, match=f"--tp 2 must divide the checkpoint's {width} 17"):
        inspect(ck.path).check_tp(2)


def test_sharded_checkpoint_finds_every_tensor(tmp_path):
    info = inspect(make_checkpoint(tmp_path, shards=2).path)
    assert len({t.file for t in info.tensors.values()}) == 2


def corrupt_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage")


def huge_header_length(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))


def out_of_bounds_offsets(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 4)  # the last tensor's bytes no longer fit


BAD = {
    "architecture": (lambda p: edit_config(p, architectures=["MixtralForCausalLM"]), "MixtralForCausalLM"),
    "rope_scaling": (lambda p: edit_config(p, rope_scaling={"type": "longrope", "short_factor": [1.0] * 3,
                                                            "long_factor": [1.0] * 3}),
                     "rope_scaling.short_factor must be a list of 4 positive numbers"),
    "rope_parameters": (lambda p: edit_config(p, drop=("rope_theta",), rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        "rope_parameters.partial_rotary_factor 0.5"),
    "missing_weights": (lambda p: os.remove(os.path.join(p, "model.safetensors")), "no weights"),
    "missing_config": (lambda p: os.remove(os.path.join(p, "config.json")), "config.json is missing"),
    "corrupt_header": (lambda p: corrupt_header(os.path.join(p, "model.safetensors")), "corrupt safetensors header"),
    "header_length": (lambda p: huge_header_length(os.path.join(p, "model.safetensors")), "header length"),
    "truncated": (lambda p: out_of_bounds_offsets(os.path.join(p, "model.safetensors")), "data_offsets"),
    "shape": (lambda p: edit_config(p, intermediate_size=48), "config.json implies"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_inspect_refuses_with_a_clear_error(tmp_path, case):
    ck = make_checkpoint(tmp_path)
    damage, words = BAD[case]
    damage(ck.path)
    with pytest.raises(CheckpointError, match=words if case != "architecture" else "not supported"):
        inspect(ck.path)


def test_missing_shard(tmp_path):
    ck = make_checkpoint(tmp_path, shards=2)
    os.remove(os.path.join(ck.path, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        inspect(ck.path)


def test_llama3_scaling_parsed_and_default_type_is_plain(tmp_path):
    ck = make_checkpoint(tmp_path, rope_scaling=LLAMA3_SCALING)
    rope = inspect(ck.path).config.rope
    assert rope.rope_type == "llama3" and rope.factor == 8.0
    edit_config(ck.path, rope_scaling={"type": "default"})
    assert inspect(ck.path).config.rope.rope_type == "default"


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
LONGROPE_SHORT = [1.0 + i / 8 for i in range(16)]  # head_dim 32: one factor per frequency
# config.json forms whose reading takes transformers' precedence rules: (keys dropped, changes)
FORMS = {
    "parameters_theta_over_top_level": ((), dict(rope_theta=3e4, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e4})),
    "top_level_theta_into_parameters": ((), dict(rope_theta=3e4, rope_parameters={"rope_type": "linear",
                                                                                   "factor": 2.0})),
    "no_theta_anywhere": (("rope_theta",), dict(rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "scaling_over_parameters": ((), dict(rope_scaling={"type": "linear", "factor": 3.0}, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e4})),
    "empty_scaling_then_parameters": (("rope_theta",), dict(rope_scaling={}, rope_parameters={
        **YARN, "rope_theta": 1e6})),
    "rope_type_over_type": ((), dict(rope_scaling={"type": "yarn", "rope_type": "linear", "factor": 4.0})),
    "top_level_original_context": ((), dict(original_max_position_embeddings=100, rope_scaling=YARN)),
    "yarn_context_defaults_to_max": ((), dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    "llama3_context_defaults_to_max": ((), dict(rope_scaling={
        k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"})),
    "yarn_null_factor_from_lengths": ((), dict(rope_scaling={**YARN, "factor": None})),
    "yarn_zero_and_null_betas": ((), dict(rope_scaling={**YARN, "beta_fast": 0, "beta_slow": None})),
    "yarn_truncated_and_not": ((), dict(rope_scaling={**YARN, "beta_fast": 20, "beta_slow": 3,
                                                      "truncate": False})),
    "whole_rotation_is_plain": ((), dict(partial_rotary_factor=1.0)),
    # dynamic NTK is plain RoPE up to max_position_embeddings, the most a node serves
    "dynamic": ((), dict(rope_scaling={"type": "dynamic", "factor": 4.0})),
    "dynamic_parameters": (("rope_theta",), dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 5e5})),
    "longrope": ((), dict(rope_scaling={"type": "longrope", "short_factor": LONGROPE_SHORT, "long_factor": [5.0] * 16,
                                        "original_max_position_embeddings": 64})),
    "longrope_top_level_context_and_factor": ((), dict(original_max_position_embeddings=100, rope_scaling={
        "type": "longrope", "short_factor": LONGROPE_SHORT, "long_factor": [5.0] * 16, "factor": 3.0})),
    "longrope_attention_factor": ((), dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e5, "short_factor": LONGROPE_SHORT, "long_factor": [5.0] * 16,
        "attention_factor": 1.3, "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("form", list(FORMS))
def test_rope_read_as_transformers_reads_it(tmp_path, form, arch):
    """kvrt's frequencies and attention factor equal the reference's, which takes the
    parameters from transformers' own reading of the same config.json."""
    ck = make_checkpoint(tmp_path, arch, head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    drop, changes = FORMS[form]
    cfg = edit_config(ck.path, drop=drop, **changes)
    inv_freq, attention_factor = reference_rope(cfg)
    config = inspect(ck.path).config
    np.testing.assert_allclose(config.inv_freq(), inv_freq, rtol=1e-12)
    assert config.rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


REFUSED = {  # config.json changes -> words the error must hold
    "dynamic_without_factor": (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
                               "rope_parameters.factor must be a positive number"),
    "longrope_without_long_factor": (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4}),
                                     "rope_scaling.long_factor must be a list of 4 positive numbers"),
    "unknown": (dict(rope_parameters={"rope_type": "ntk-by-parts", "rope_theta": 1e4}),
                "rope_parameters.rope_type 'ntk-by-parts'"),
    "per_layer_type": (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                       "rope_parameters.full_attention"),
    "partial_rotation": (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    "yarn_without_factor": (dict(rope_scaling={"type": "yarn", "original_max_position_embeddings": 64}),
                            "rope_scaling.factor is missing"),
    "yarn_negative_beta": (dict(rope_scaling={**YARN, "beta_fast": -4}),
                           "rope_scaling.beta_fast must be a positive number, got -4"),
    "null_theta": (dict(rope_parameters={"rope_type": "default", "rope_theta": None}),
                   "rope_parameters.rope_theta must be a positive number, got None"),
    "llama3_incomplete": (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
                          "rope_parameters.low_freq_factor"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_rope_refused_naming_the_key(tmp_path, case):
    ck = make_checkpoint(tmp_path)
    changes, words = REFUSED[case]
    edit_config(ck.path, **changes)
    with pytest.raises(CheckpointError, match="config.json: ") as e:
        inspect(ck.path)
    assert words in str(e.value)


def test_fingerprint_roots_block_keys(tmp_path):
    """Two checkpoints of one shape never share block keys; the same checkpoint always does;
    and neither shares them with the reference model."""
    a, b = make_checkpoint(tmp_path / "a", seed=0), make_checkpoint(tmp_path / "b", seed=0, rms_norm_eps=1e-6)
    fa, fb = inspect(a.path), inspect(b.path)
    assert fa.fingerprint == inspect(a.path).fingerprint and fa.fingerprint != fb.fingerprint
    tuned = make_checkpoint(tmp_path / "c", seed=1)  # a's config and headers, other weights
    assert inspect(tuned.path).fingerprint != fa.fingerprint

    def cfg(info) -> NodeConfig:
        return NodeConfig(node="n", model_dir=info.model_dir, model_arch=info.config.arch,
                          model_fingerprint=info.fingerprint, hidden_size=32, **info.node_shape()).validate()

    roots = {cfg(fa).key_root, cfg(fb).key_root, NodeConfig(node="n", **fa.node_shape()).validate().key_root}
    assert len(roots) == 3
    with pytest.raises(ConfigError, match="fingerprint"):
        NodeConfig(node="n", model_dir=fa.model_dir, hidden_size=32, **fa.node_shape()).validate()


def test_tp_must_split_heads_and_mlp_evenly(tmp_path):
    info = inspect(make_checkpoint(tmp_path).path)
    info.check_tp(2)
    with pytest.raises(CheckpointError, match="--tp 4 must divide the checkpoint's num_key_value_heads 2"):
        info.check_tp(4)


def launch_fails(node: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert leftovers(node) == [], "refused before any shared memory or process exists"
    assert "Traceback" not in r.stderr
    return r.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["architecture", "rope_scaling", "rope_parameters", "missing_weights",
                                  "corrupt_header"])
def test_launch_refuses_bad_checkpoint_before_starting(node, tmp_path, case):
    ck = make_checkpoint(tmp_path)
    damage, words = BAD[case]
    damage(ck.path)
    err = launch_fails(node, "--model", ck.path)
    assert "kvrt launch: error:" in err and words in err, err


@pytest.mark.e2e
@pytest.mark.parametrize("flag,value,words", [
    ("--num-layers", "3", "contradicts"), ("--head-dim", "16", "contradicts"),
    ("--vocab-size", "512", "contradicts"), ("--max-model-len", "1024", "max_position_embeddings"),
    ("--tp", "4", "must divide"),
])
def test_launch_refuses_contradicting_shape_flags(node, tmp_path, flag, value, words):
    ck = make_checkpoint(tmp_path)
    err = launch_fails(node, "--model", ck.path, flag, value)
    assert flag in err and words in err, err


@pytest.mark.e2e
def test_launch_caps_longrope_at_its_original_context(node, tmp_path):
    from tests.hfkit import case_config

    arch, cfg = case_config("phi3")  # longrope, original context 256 of 512
    ck = make_checkpoint(tmp_path, arch, config=cfg)
    err = launch_fails(node, "--model", ck.path, "--max-model-len", "300")
    assert "--max-model-len 300 exceeds 256" in err and "longrope" in err, err


def test_worker_refuses_a_checkpoint_changed_since_launch(tmp_path):
    """Block keys are rooted in the fingerprint the launcher took: a worker loading different
    weights under the same name would serve KV that does not match its keys."""
    from kvrt.workers.model.hf_model import HFModel

    ck = make_checkpoint(tmp_path)
    before = inspect(ck.path).fingerprint
    HFModel.load(ck.path, before, 512)
    make_checkpoint(tmp_path, seed=1)  # same config and headers, other weights: a "fine-tune"
    with pytest.raises(CheckpointError, match="changed since the node was launched"):
        HFModel.load(ck.path, before, 512)


def test_safetensors_package_agrees_on_bf16_headers(tmp_path):
    from safetensors import safe_open

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", tied=True)
    info = inspect(ck.path)
    with safe_open(os.path.join(ck.path, "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(info.tensors)
        for name in f.keys():
            sl = f.get_slice(name)
            assert sl.get_dtype() == "BF16" and tuple(sl.get_shape()) == info.tensors[name].shape


def test_header_with_a_huge_shape_is_refused(tmp_path):
    """A shape whose byte count would overflow 64 bits must not pass as matching its offsets."""
    path = str(tmp_path / "x.safetensors")
    header = {"a": {"dtype": "F32", "shape": [2 ** 62, 4], "data_offsets": [0, 0]}}  # 2**64 bytes: 0 in int64
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(16))
    from kvrt.workers.model.checkpoint import read_header

    with pytest.raises(CheckpointError, match="data_offsets"):
        read_header(path)
