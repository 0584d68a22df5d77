"""Build a model from a local HF checkpoint directory (safetensors) or with dummy weights.

The module is first built on the meta device, then each parameter is allocated once,
directly in the target dtype and device, so a checkpoint never needs two copies in memory.
Checkpoint tensors are read shard by shard and copied into parameters by name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from engine_core.attention.backend import AttentionBackend
from engine_core.config import ModelConfig
from engine_core.dtypes import resolve_dtype_name
from engine_core.errors import ModelLoadError
from engine_core.layers.linear import MergedLinear
from engine_core.models.registry import get_model_class
from engine_core.models.spec import ModelSpec
from engine_core.parallel.group import TensorParallelGroup
from engine_core.parallel.sharding import Shard
from engine_core.worker.memory_arena import MemoryArena

logger = logging.getLogger("pdserve.loader")

# Checkpoint tensors that are derived state, never parameters (old Llama exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_NAMES_IN_ERROR = 5


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` of a checkpoint directory into a ModelSpec."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {str(directory)!r} does not exist "
                             "(only local checkpoint directories are supported)")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{str(directory)!r} has no config.json; is it an HF checkpoint?")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from None
    return ModelSpec.from_hf_config(config)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    """The parameter dtype (``dtypes.resolve_dtype_name``'s rules) as a ``torch.dtype``."""
    return getattr(torch, resolve_dtype_name(dtype, checkpoint_dtype, device))


def load_model(model_config: ModelConfig, spec: ModelSpec, device: str, dtype: torch.dtype,
               attn_backend: AttentionBackend, sleepable: bool = False,
               tp: TensorParallelGroup | None = None) -> nn.Module:
    """Build ``spec``'s model on ``device`` in ``dtype`` with its weights, in eval mode.

    ``tp``: the rank's tensor-parallel group; the rank builds and loads only its shards.

    ``sleepable`` (sleep mode) places every parameter in one ``MemoryArena`` that the model
    owns (``weights_arena``): sleeping gives its memory back and waking restores it at the
    same addresses, so CUDA graphs survive.
    """
    model_class = get_model_class(spec.architecture)
    with torch.device("meta"):
        model = model_class(spec, attn_backend, tp)
    arena = None
    if sleepable:
        shapes = [(p.shape, dtype) for _, p in model.named_parameters()]
        arena = MemoryArena(MemoryArena.size_of(shapes), device)
    _materialize(model, device, dtype, arena)
    model.weights_arena = arena
    load_weights(model, model_config, spec)
    return model.eval()


def weights_arena(model: nn.Module) -> MemoryArena | None:
    """The arena holding a sleepable model's parameters (None otherwise)."""
    return getattr(model, "weights_arena", None)


def load_weights(model: nn.Module, model_config: ModelConfig, spec: ModelSpec) -> None:
    """Fill a materialised model's parameters as ``load_model`` does (checkpoint or dummy);
    sleep level 2 reloads through this on wake-up."""
    if model_config.load_format == "dummy":
        _init_dummy_weights(model, model_config.seed)
    else:
        _load_safetensors(model, Path(model_config.model), spec)


def _materialize(model: nn.Module, device: str, dtype: torch.dtype,
                 arena: MemoryArena | None) -> None:
    """Replace meta parameters with real, uninitialised ones (tied ones stay tied), taken
    from ``arena`` when given, in the meta parameter's layout (a transposed 2-D view stays
    one: ``Linear(transposed=True)``).

    Buffers (RoPE frequencies) were built on CPU in float32 on purpose and keep their dtype.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                transposed = param.dim() == 2 and not param.is_contiguous()
                assert not transposed or param.stride() == (1, param.shape[0]), name
                shape = param.shape[::-1] if transposed else param.shape
                storage = (torch.empty(shape, dtype=dtype, device=device) if arena is None
                           else arena.take(shape, dtype))
                replaced[id(param)] = nn.Parameter(storage.t() if transposed else storage,
                                                   requires_grad=False)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small uniform values with real shapes (benchmarks); norms at 1 so activations stay sane."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif param.is_contiguous():
            param.data.uniform_(-1e-3, 1e-3, generator=generator)
        else:  # drawn in the logical order, so the values do not depend on the layout
            drawn = torch.empty(param.shape, dtype=param.dtype, device=device)
            param.data.copy_(drawn.uniform_(-1e-3, 1e-3, generator=generator))


def checkpoint_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor name -> the parameter, or the rows of a merged parameter, it fills.

    A ``MergedLinear`` (q/k/v, gate/up) takes its parts' tensors under their own checkpoint
    names (``...self_attn.k_proj.weight`` -> rows of ``...self_attn.qkv_proj.weight``). A
    tied parameter is listed once, under the name met first (the input embedding).
    """
    return {name: target for name, target, _ in _checkpoint_entries(model)}


def _checkpoint_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Shard | None]]:
    """(checkpoint name, target, the rank's ``Shard`` of the checkpoint tensor or None for
    all of it) for each entry of ``checkpoint_targets``; sharded layers name their shard
    (``checkpoint_shard``, engine_core/parallel/layers.py)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        parent = module_name.rpartition(".")[0]
        shard_of = getattr(module, "checkpoint_shard", None)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, MergedLinear):
                for index, part in enumerate(module.part_names):
                    name = f"{parent}.{part}.{param_name}" if parent else f"{part}.{param_name}"
                    yield (name, param.data[module.part_slice(index)],
                           shard_of(param_name, index) if shard_of else None)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                yield name, param.data, shard_of(param_name, None) if shard_of else None


def _shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: index-listed shards or the single file."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: "
                                 f"{missing[:_MAX_NAMES_IN_ERROR]}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights "
                             "(use --load-format dummy for random weights)")
    return files


def _load_safetensors(model: nn.Module, model_dir: Path, spec: ModelSpec) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, shard by shard."""
    from safetensors import safe_open

    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    entries = list(_checkpoint_entries(model))
    params = {name: target for name, target, _ in entries}
    shards = {name: shard for name, _, shard in entries if shard is not None}
    files = _shard_files(model_dir)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for shard_idx, file in enumerate(files, start=1):
        num_bytes = 0
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    if not (spec.tie_word_embeddings and name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                # Tensor parallelism: only this rank's slice is read.
                tensor = (shards[name].read(shard.get_slice(name)) if name in shards
                          else shard.get_tensor(name))
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}")
                target.copy_(tensor)  # casts to the parameter's dtype and device
                loaded.add(name)
                num_bytes += tensor.numel() * tensor.element_size()
        logger.info("loaded shard %d/%d %s (%.1f MiB)", shard_idx, len(files), file.name,
                    num_bytes / 2**20)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. "
            f"{missing[:_MAX_NAMES_IN_ERROR]}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s",
                       len(unexpected), unexpected[:_MAX_NAMES_IN_ERROR])
