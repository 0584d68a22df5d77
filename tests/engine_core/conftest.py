"""Fixtures of the model-side tests: tiny checkpoints (built once per session) and metadata."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.attention.metadata import AttentionMetadata

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> build_checkpoint kwargs. GQA everywhere; tied and untied; two RoPE scalings.
MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    "llama-llama3rope": dict(arch="llama", num_layers=3, hidden_size=64, num_heads=4,
                             num_kv_heads=2, intermediate_size=128,
                             rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "qwen2-tied-linear": dict(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4,
                              num_kv_heads=1, intermediate_size=96, tie_word_embeddings=True,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3-headdim32": dict(arch="qwen3", num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=32, intermediate_size=128),
}


@pytest.fixture(scope="session")
def model_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``build(variant, **overrides) -> path``; each distinct build happens once a session."""
    from engine_core.demo_model import build_checkpoint

    @functools.cache
    def build(variant: str, shards: int = 1) -> Path:
        path = tmp_path_factory.mktemp(f"{variant}-{shards}")
        return build_checkpoint(path, seed=7, shards=shards, **MODEL_VARIANTS[variant])

    return build


@pytest.fixture(scope="session")
def make_metadata() -> Callable[..., AttentionMetadata]:
    """``make(new_tokens, cached_tokens, block_tables, block_size) -> AttentionMetadata``."""
    return _make_metadata


@pytest.fixture(scope="session")
def positions_of() -> Callable[[list[int], list[int]], torch.Tensor]:
    """``positions(new_tokens, cached_tokens) -> [T]`` absolute positions of a step."""
    return _positions_of


def _make_metadata(new_tokens: list[int], cached_tokens: list[int],
                  block_tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """Metadata of one step: sequence i adds ``new_tokens[i]`` after ``cached_tokens[i]``."""
    slots, starts = [], [0]
    for num_new, num_cached, table in zip(new_tokens, cached_tokens, block_tables):
        positions = torch.arange(num_cached, num_cached + num_new)
        blocks = torch.tensor(table)[positions // block_size]
        slots.append(blocks * block_size + positions % block_size)
        starts.append(starts[-1] + num_new)
    seq_lens = [n + c for n, c in zip(new_tokens, cached_tokens)]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(new_tokens), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def _positions_of(new_tokens: list[int], cached_tokens: list[int]) -> torch.Tensor:
    """Absolute positions of a step's flattened tokens."""
    return torch.cat([torch.arange(c, c + n) for n, c in zip(new_tokens, cached_tokens)])
