"""Which slice of each checkpoint tensor a rank holds: pure arithmetic, no torch device.

A ``Shard`` is a range along one dimension of the full (checkpoint) tensor; the loader
cuts each tensor with its shard before copying it into the rank's parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from engine_core.errors import ConfigError
from engine_core.models.spec import ModelSpec
from engine_core.parallel.kv_layout import kv_head_range


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, start + size)`` along ``dim`` of the full tensor. A range running past
    the tensor's end (the last rank of a padded vocabulary) is filled with zeros."""

    dim: int
    start: int
    size: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        dim = self.dim % tensor.dim()
        length = tensor.shape[dim]
        end = min(self.start + self.size, length)
        part = tensor.narrow(dim, min(self.start, length), max(end - self.start, 0))
        if part.shape[dim] == self.size:
            return part
        shape = list(tensor.shape)
        shape[dim] = self.size
        padded = torch.zeros(shape, dtype=tensor.dtype)
        padded.narrow(dim, 0, part.shape[dim]).copy_(part)
        return padded

    def read(self, lazy: Any) -> torch.Tensor:
        """This shard of a checkpoint tensor not yet read (safetensors' ``get_slice``):
        only its rows come off the disk."""
        shape = lazy.get_shape()
        dim = self.dim % len(shape)
        index = [slice(None)] * len(shape)
        index[dim] = slice(min(self.start, shape[dim]), min(self.start + self.size, shape[dim]))
        return Shard(dim, 0, self.size).take(lazy[tuple(index)])


def even_shard(total: int, rank: int, size: int, dim: int = 0) -> Shard:
    """Rank ``rank``'s equal part of ``total`` rows (``total`` must divide by ``size``)."""
    if total % size:
        raise ConfigError(f"{total} does not split evenly over tensor-parallel size {size}")
    part = total // size
    return Shard(dim, rank * part, part)


@dataclass(frozen=True)
class HeadPartition:
    """The attention heads one rank computes: a contiguous run of query heads and the KV
    heads they read. With fewer KV heads than ranks each KV head is replicated on
    ``size / num_kv_heads`` ranks."""

    q_start: int
    num_q_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadPartition:
        if num_heads % size:
            raise ConfigError(f"{num_heads} attention heads do not split over "
                              f"--tensor-parallel-size {size}")
        kv_start, kv_per_rank = kv_head_range(num_kv_heads, rank, size)
        q_per_rank = num_heads // size
        return cls(rank * q_per_rank, q_per_rank, kv_start, kv_per_rank)


def padded_vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the embedding and LM head each rank holds (the vocabulary padded up)."""
    return -(-vocab_size // size)


def rank_local_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """``spec`` as one rank's KV cache and attention kernels see it (its heads only)."""
    if size == 1:
        return spec
    heads = HeadPartition.of(spec.num_attention_heads, spec.num_key_value_heads, 0, size)
    return replace(spec, num_attention_heads=heads.num_q_heads,
                   num_key_value_heads=heads.num_kv_heads)
