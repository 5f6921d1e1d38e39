"""Where a checkpoint's layer windows come from at launch (launcher._model_settings, no process
started): each layer's window as the architecture's reader takes config.json (transformers'
reading, workers/model/archs/), the one source that the node config's layer groups (the pool's
pages, the prefix cache's side groups) and the worker's model both take, so they agree; a
window no shorter than --max-model-len is none; --layer-windows agrees with config.json or is
refused; and the torch backend, which implements neither FP8 blocks nor layer groups, is refused
for them by name while auto keeps the array path."""
from __future__ import annotations

import argparse

import pytest

from kvrt import launcher
from kvrt.runtime.node.config import NodeConfig
from kvrt.workers.model.backends import resolve_backend
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from tests.hfkit import case_config, make_checkpoint


def settings(*argv: str, device: str = "cpu") -> tuple[dict, dict]:
    args = launcher._add_launch(argparse.ArgumentParser().add_subparsers()).parse_args(["--port", "1", *argv])
    return launcher._model_settings(args, NodeConfig(node=""), device)


def checkpoint(tmp_path, case: str) -> str:
    arch, cfg = case_config(case)
    return make_checkpoint(tmp_path / case, arch, config=cfg).path


@pytest.mark.parametrize("case, windows", [("gemma3", [12, 0]), ("gemma2", [12, 0]), ("qwen2-sliding", [0, 12]),
                                           ("mistral", [12, 12]), ("qwen3-moe", [])])
def test_node_and_model_take_the_checkpoints_windows(tmp_path, case, windows):
    path = checkpoint(tmp_path, case)
    shape, model = settings("--model", path, "--max-model-len", "256")
    assert shape["layer_windows"] == windows
    assert list(inspect(path).config.features.windows) == (windows or [0, 0])
    cfg = NodeConfig(node="n", **shape, **model)
    cfg.validate()
    hf = HFModel(inspect(path), cfg.max_model_len)
    assert hf.shape.windows == tuple(windows or (0, 0))
    assert hf.shape.groups == cfg.kv_groups
    assert hf.shape.kv_layout(cfg.block_size, cfg.kv_dtype) == cfg.kv_layout
    assert cfg.kv_groups.hybrid == (len(set(windows)) > 1)


def test_a_window_no_shorter_than_the_context_is_none(tmp_path):
    path = checkpoint(tmp_path, "gemma3")
    assert settings("--model", path, "--max-model-len", "12")[0]["layer_windows"] == []
    assert settings("--model", path, "--max-model-len", "13")[0]["layer_windows"] == [12, 0]
    assert HFModel(inspect(path), 12).shape.layer_windows == ()


def test_layer_windows_flag_must_agree_with_config_json(tmp_path):
    path = checkpoint(tmp_path, "gemma2")
    assert settings("--model", path, "--layer-windows", "12,0")[0]["layer_windows"] == [12, 0]
    with pytest.raises(ValueError, match="contradicts"):
        settings("--model", path, "--layer-windows", "0,0")
    assert settings("--layer-windows", "0,5", "--num-layers", "2")[0]["layer_windows"] == [0, 5]


def test_torch_backend_refuses_fp8_blocks_and_layer_groups_by_name(tmp_path):
    llama = checkpoint(tmp_path, "llama-dynamic")
    with pytest.raises(ValueError, match="fp8.*FP8 e4m3"):
        settings("--model", llama, "--model-backend", "torch", "--kv-cache-dtype", "fp8")
    with pytest.raises(ValueError, match="layer groups"):
        settings("--model", checkpoint(tmp_path, "qwen2-sliding"), "--model-backend", "torch")
    config = inspect(llama).config
    for kv in ("fp8", "fp8_e4m3"):
        assert resolve_backend("auto", "cuda", config, kv) == "array"
    assert settings("--model", llama, "--kv-cache-dtype", "fp8", device="cuda")[1]["model_backend"] == "array"
