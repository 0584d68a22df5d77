"""Convert a GGUF file once into a cached HF-style checkpoint directory.

The cache entry is keyed by the file's resolved path, size and modification time, the
serving dtype and the converter version, so a changed file or dtype converts again and
every later start loads plain safetensors. Concurrent first starts (the workers of one
launch) take a file lock: one converts, the others wait and reuse its result.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_core.config import EngineConfig
from engine_core.dtypes import resolve_dtype_name
from engine_core.errors import ModelLoadError
from engine_core.gguf import reader as gguf_reader

logger = logging.getLogger("pdserve.gguf")

# Bump when the directory this module writes changes; old entries are then rebuilt.
CONVERTER_VERSION = "2"
# What ``--dtype auto`` serves a GGUF file in on an accelerator (CPU runs float32 anyway):
# the files carry no single dtype, and bfloat16 keeps float32's range.
GGUF_AUTO_DTYPE = "bfloat16"
# A shard is written once it holds this many bytes, bounding the conversion's memory.
_SHARD_BYTES = 2 << 30
_DONE_MARKER = "pdserve_gguf.json"


def default_cache_root() -> Path:
    """Where converted checkpoints live unless ``--gguf-cache-dir`` says otherwise."""
    return Path.home() / ".cache" / "pdserve" / "gguf"


def converted_config(config: EngineConfig) -> EngineConfig:
    """``config``, whose model is a GGUF file, with it replaced by its converted directory
    (converted now if not cached); the served name stays the file's as given."""
    model = config.model
    device = config.device.resolve()
    dtype = resolve_dtype_name(model.dtype, GGUF_AUTO_DTYPE, device)
    root = Path(model.gguf_cache_dir) if model.gguf_cache_dir else default_cache_root()
    directory = converted_checkpoint(Path(model.model), dtype, root)
    return dataclasses.replace(config, model=dataclasses.replace(
        model, model=str(directory), served_model_name=model.served_model_name or model.model))


def converted_checkpoint(path: Path, dtype: str, cache_root: Path) -> Path:
    """The cache directory holding ``path`` converted to ``dtype`` (a canonical name,
    ``dtypes.DTYPE_ALIASES``' values), converting on a miss; a hit imports no torch."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    key = hashlib.sha256(json.dumps(
        [str(path.resolve()), stat.st_size, stat.st_mtime_ns, dtype,
         CONVERTER_VERSION]).encode()).hexdigest()[:16]
    target = cache_root / f"{path.stem}-{dtype}-{key}"
    if (target / _DONE_MARKER).is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with open(cache_root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / _DONE_MARKER).is_file():
            return target  # another process converted it while we waited
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_root))
        try:
            write_checkpoint(path, dtype, staging)
            if target.exists():
                shutil.rmtree(target)  # an entry left without its marker
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def write_checkpoint(path: Path, dtype: str, directory: Path) -> None:
    """Write ``path`` as an HF checkpoint into ``directory``: config, generation config,
    tokenizer, and the weights dequantized to ``dtype`` as safetensors shards."""
    import torch

    started = time.monotonic()
    logger.info("Converting GGUF %s to %s in %s (once; later starts reuse it)",
                path, dtype, directory.parent)
    reader = gguf_reader.open_gguf(path)
    config = gguf_reader.hf_config(reader, dtype)
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", {
        "eos_token_id": gguf_reader.stop_token_ids(reader),
        **{k: config[k] for k in ("bos_token_id", "pad_token_id") if k in config}})
    _save_tokenizer(path, directory)
    tensors = _progress(gguf_reader.iter_hf_tensors(reader, config), total=len(reader.tensors))
    total_bytes, num_shards = _write_shards(
        ((name, torch.from_numpy(values.copy()).to(getattr(torch, dtype)))
         for name, values in tensors),
        directory)
    stat = path.stat()
    _write_json(directory / _DONE_MARKER, {
        "source": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype, "converter_version": CONVERTER_VERSION})
    logger.info("Converted %s in %.1f s: %d shard(s), %.1f MiB", path.name,
                time.monotonic() - started, num_shards, total_bytes / 2**20)


def _write_shards(tensors: Any, directory: Path) -> tuple[int, int]:
    """Save (name, tensor) pairs as HF does: ``model.safetensors``, or numbered shards of
    about ``_SHARD_BYTES`` with their index. Returns (bytes written, number of shards)."""
    from safetensors.torch import save_file

    shard_maps: list[list[str]] = []
    shard: dict[str, Any] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        save_file(shard, str(directory / f".shard-{len(shard_maps)}"))
        shard_maps.append(list(shard))

    for name, tensor in tensors:
        shard[name] = tensor.contiguous()
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= _SHARD_BYTES:
            flush()
            total_bytes, shard, shard_bytes = total_bytes + shard_bytes, {}, 0
    if shard or not shard_maps:
        flush()
        total_bytes += shard_bytes
    count = len(shard_maps)
    names = (["model.safetensors"] if count == 1 else
             [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)])
    for index, file_name in enumerate(names):
        os.replace(directory / f".shard-{index}", directory / file_name)
    if count > 1:
        _write_json(directory / "model.safetensors.index.json", {
            "metadata": {"total_size": total_bytes},
            "weight_map": {n: file_name for file_name, shard_names in zip(names, shard_maps)
                           for n in shard_names}})
    return total_bytes, count


def _save_tokenizer(path: Path, directory: Path) -> None:
    """The file's tokenizer and chat template, converted by transformers' GGUF support."""
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent),
                                                            gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {exc}") from None
    tokenizer.save_pretrained(str(directory))


def _progress(items: Any, total: int) -> Any:
    """A tqdm bar over the tensors on a terminal; plain iteration elsewhere."""
    from tqdm import tqdm

    return tqdm(items, total=total, desc="Dequantizing GGUF tensors", unit="tensor",
                disable=None)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
