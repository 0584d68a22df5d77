"""Sizing and allocating the per-layer paged KV cache tensors.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V), the
one layout used by the attention backends, the runner and the connector.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.config import CacheConfig
from engine_core.errors import ConfigError
from engine_core.models.spec import ModelSpec
from engine_core.worker.memory_arena import MemoryArena

logger = logging.getLogger("pdserve.kv_cache")

# On CPU with no explicit size, take at most this much memory for KV (1 GiB: zeroing more
# makes a CPU demo start slowly; --kv-cache-memory-bytes raises it).
DEFAULT_CPU_KV_BYTES = 1 << 30

_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(cache_config: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the cache: the model dtype unless an fp8 variant was asked for."""
    return _FP8_DTYPES.get(cache_config.kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class KVCacheShape:
    """How many blocks of what shape each layer gets."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_cache(spec: ModelSpec, cache_config: CacheConfig, dtype: torch.dtype, device: str,
                  max_model_len: int, max_num_seqs: int,
                  profile_peak_bytes: Callable[[], int] | None = None,
                  held_bytes: int = 0) -> KVCacheShape:
    """Decide the number of blocks from the config and (on GPU) a profiled peak.
    ``held_bytes``: device memory the engine holds outside PyTorch's allocator (sleep
    mode's weights arena), which ``memory_allocated`` does not count."""
    per_block = KVCacheShape(spec.num_hidden_layers, 1, cache_config.block_size,
                             spec.num_key_value_heads, spec.head_dim, dtype).bytes_per_block
    if cache_config.num_gpu_blocks_override is not None:
        num_blocks = cache_config.num_gpu_blocks_override
    elif cache_config.kv_cache_memory_bytes is not None:
        num_blocks = cache_config.kv_cache_memory_bytes // per_block
    elif device.startswith("cuda"):
        cuda = torch.device(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(cuda)
        peak = profile_peak_bytes() if profile_peak_bytes is not None else 0
        # This instance's share is a fraction of the whole card, less what it already holds
        # (weights) and its worst-case step; never more than is actually free (other
        # processes), keeping a small margin for the CUDA context and allocator slack.
        share = (total * cache_config.gpu_memory_utilization
                 - torch.cuda.memory_allocated(cuda) - held_bytes)
        budget = min(share, free - (256 << 20)) - peak
        num_blocks = int(budget // per_block)
    else:
        # CPU: the fixed default, but never more than every sequence at full length needs.
        blocks_per_seq = -(-max_model_len // cache_config.block_size)
        num_blocks = min(DEFAULT_CPU_KV_BYTES // per_block, max_num_seqs * blocks_per_seq + 1)
    if num_blocks < 2:
        raise ConfigError(
            f"not enough memory for the KV cache ({num_blocks} blocks of {per_block} bytes); "
            "raise --gpu-memory-utilization or --kv-cache-memory-bytes, or lower --max-model-len")
    shape = KVCacheShape(spec.num_hidden_layers, int(num_blocks), cache_config.block_size,
                         spec.num_key_value_heads, spec.head_dim, dtype)
    where = "GPU" if device.startswith("cuda") else "CPU"
    logger.info("%s KV cache size: %d tokens (%d blocks, %.2f GiB)", where, shape.num_tokens,
                shape.num_blocks, shape.num_blocks * per_block / (1 << 30))
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_model_len,
                shape.num_tokens / max_model_len)
    if shape.num_tokens < max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: long "
                       "requests will preempt each other", shape.num_tokens, max_model_len)
    return shape


def allocate_kv_caches(shape: KVCacheShape, device: str,
                       arena: MemoryArena | None = None) -> list[torch.Tensor]:
    """One zeroed tensor per layer, all consecutive slices of ONE allocation (taken from
    ``arena`` when given: sleep mode).

    The layers stay separate tensors for the attention kernels, but the KV connector sees
    them as one ``[layers, 2, blocks, ...]`` tensor and moves a request's blocks of every
    layer with one gather or scatter kernel (``engine_core/worker/block_copy.py``).
    """
    dims = (shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads,
            shape.head_dim)
    if arena is None:
        whole = torch.zeros(dims, dtype=shape.dtype, device=device)
    else:
        whole = arena.take(dims, shape.dtype).zero_()
    return list(whole.unbind(0))


def kv_cache_nbytes(shape: KVCacheShape) -> int:
    """Bytes of ``allocate_kv_caches``'s one allocation."""
    return shape.num_blocks * shape.bytes_per_block
