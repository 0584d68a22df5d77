"""Loading checkpoints: shards, dtype choice, dummy weights and the error messages."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.attention.backend import get_attention_backend
from engine_core.attention.torch_ref import TorchRefAttentionBackend
from engine_core.config import ModelConfig
from engine_core.errors import ModelLoadError
from engine_core.worker.loader import (
    checkpoint_targets,
    load_model,
    read_model_spec,
    resolve_dtype,
)

VARIANT = "qwen3-headdim32"


def _load(path: Path | str, load_format: str = "auto", seed: int = 0,
          dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = ModelConfig(model=str(path), load_format=load_format, seed=seed)
    spec = read_model_spec(path)
    return load_model(config, spec, "cpu", dtype, get_attention_backend("cpu", "auto"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_equals_unsharded(model_checkpoint, caplog) -> None:
    sharded_dir = model_checkpoint(VARIANT, shards=3)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    with caplog.at_level(logging.INFO, logger="pdserve.loader"):
        sharded = _load(sharded_dir)
    assert sum("loaded shard" in r.getMessage() for r in caplog.records) >= 2
    single = _load(model_checkpoint(VARIANT))
    assert not sharded.training
    single_state = single.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, single_state[name]), name


def test_weights_equal_checkpoint_and_cast(model_checkpoint) -> None:
    path = model_checkpoint(VARIANT)
    tensors = load_file(str(path / "model.safetensors"))
    model = _load(path, dtype=torch.bfloat16)
    params = checkpoint_targets(model)  # merged q/k/v and gate/up rows by checkpoint name
    assert set(params) == set(tensors)
    for name, tensor in tensors.items():
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], tensor.to(torch.bfloat16)), name
    # The merged weights hold the parts in order: q, k, v rows; gate, up rows.
    layer = "model.layers.1"
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([tensors[f"{layer}.self_attn.{p}_proj.weight"]
                                       for p in "qkv"]).to(torch.bfloat16))
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([tensors[f"{layer}.mlp.{p}_proj.weight"]
                                           for p in ("gate", "up")]).to(torch.bfloat16))
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE stays float32


def test_tied_checkpoint_without_lm_head(model_checkpoint) -> None:
    path = model_checkpoint("qwen2-tied-linear")
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = _load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_directory_and_config(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_model_spec(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        read_model_spec(tmp_path)


def test_unsupported_architecture(model_checkpoint, tmp_path) -> None:
    path = _copy(model_checkpoint(VARIANT), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="MambaForCausalLM"):
        read_model_spec(path)


def test_missing_tensor_is_named(model_checkpoint, tmp_path) -> None:
    path = _copy(model_checkpoint(VARIANT), tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)  # ignored
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(path)


def test_shape_mismatch(model_checkpoint, tmp_path) -> None:
    path = _copy(model_checkpoint(VARIANT), tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        _load(path)


def test_no_weights_file(model_checkpoint, tmp_path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(model_checkpoint(VARIANT) / "config.json", path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        _load(path)


def test_dummy_load_shapes_and_determinism(model_checkpoint, tmp_path) -> None:
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(model_checkpoint(VARIANT) / "config.json", path / "config.json")
    first, second = _load(path, "dummy", seed=3), _load(path, "dummy", seed=3)
    other = _load(path, "dummy", seed=4)
    real = _load(model_checkpoint(VARIANT))
    real_state = real.state_dict()
    for name, tensor in first.state_dict().items():
        assert tensor.shape == real_state[name].shape, name
        assert torch.equal(tensor, second.state_dict()[name]), name
        assert tensor.isfinite().all()
    q = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(first.state_dict()[q], other.state_dict()[q])
    assert first.state_dict()[q].abs().max() <= 1e-3


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32   # CPU half is slow
    assert resolve_dtype("auto", "float16", "cuda:1") == torch.float16
    assert resolve_dtype("auto", None, "cuda") == torch.float32
    assert resolve_dtype("bf16", "float32", "cpu") == torch.bfloat16   # explicit wins
    assert resolve_dtype("half", None, "cuda") == torch.float16


class _SplitKLayoutBackend(TorchRefAttentionBackend):
    """The torch reference with the Triton path's model options, so that the MLP stores its
    down weight transposed (the split-K layout) on any device; on CPU every layer still
    runs torch code."""

    triton_layers = True
    gemv_max_rows = 8
    split_k_mlp = True


class _NoSplitKBackend(_SplitKLayoutBackend):
    """The same with ``--split-k-mlp off`` (or auto on a GPU not measured faster)."""

    split_k_mlp = False


@pytest.mark.parametrize("sleepable", [False, True])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_transposed_down_weight_loads_and_computes_alike(model_checkpoint, tmp_path,
                                                         sleepable: bool,
                                                         load_format: str) -> None:
    """With the split-K layout the down weight is a transposed view of its own storage
    (in the sleep arena too), filled by name from the checkpoint or drawn from the seed
    exactly as the plain layout is, and the model computes the same logits."""
    path = model_checkpoint(VARIANT)
    if load_format == "dummy":
        path = tmp_path / "config-only"
        path.mkdir()
        shutil.copy(model_checkpoint(VARIANT) / "config.json", path / "config.json")
    config = ModelConfig(model=str(path), load_format=load_format, seed=5)
    spec = read_model_spec(path)
    plain = load_model(config, spec, "cpu", torch.float32, TorchRefAttentionBackend())
    split = load_model(config, spec, "cpu", torch.float32, _SplitKLayoutBackend(),
                       sleepable=sleepable)
    off = load_model(config, spec, "cpu", torch.float32, _NoSplitKBackend())
    assert not any(layer.mlp.split_k or not layer.mlp.down_proj.weight.is_contiguous()
                   for layer in off.model.layers)
    for layer, reference, unsplit in zip(split.model.layers, plain.model.layers,
                                         off.model.layers):
        down = layer.mlp.down_proj.weight
        assert layer.mlp.split_k and not reference.mlp.split_k
        assert down.shape == reference.mlp.down_proj.weight.shape
        assert down.stride() == (1, down.shape[0]) and down.t().is_contiguous()
        assert layer.mlp.down_proj.gemv_max_rows == 0  # the GEMV streams rows of W
        assert unsplit.mlp.down_proj.gemv_max_rows == 8
    plain_state = plain.state_dict()
    for name, tensor in split.state_dict().items():
        assert torch.equal(tensor, plain_state[name]), name
    if sleepable:
        arena = split.weights_arena
        base, end = arena.tensor.data_ptr(), arena.tensor.data_ptr() + arena.nbytes
        assert all(base <= p.data_ptr() < end for p in split.parameters())
    hidden = torch.randn(8, spec.hidden_size)
    for layer, reference in zip(split.model.layers, plain.model.layers):
        torch.testing.assert_close(layer.mlp(hidden), reference.mlp(hidden))
