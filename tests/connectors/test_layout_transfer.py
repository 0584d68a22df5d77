"""KV between tensor-parallel layouts, data path without sockets: every route of
``plan_head_routes`` gathers its head slice from the producer rank's paged cache and
scatters it into the consumer rank's, and each consumer rank ends up with exactly the KV a
single-device cache holds for its heads."""

from __future__ import annotations

import pytest
import torch

from connectors.p2p_nccl.kv_layout import plan_head_routes
from engine_core.parallel.kv_layout import KVLayout
from engine_core.worker.block_copy import (
    HeadSlice,
    block_ids_tensor,
    gather_layers,
    scatter_layers,
    wire_shape,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 10, 4, 8


def rank_caches(full: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """Each rank's stacked cache ``[layers, 2, blocks, block_size, its heads, head_dim]``."""
    caches = []
    for rank in range(layout.tp_size):
        own = layout.rank_layout(rank)
        part = full[..., own.kv_head_start:own.kv_head_start + own.num_kv_heads, :]
        caches.append(part.contiguous())
    return caches


@pytest.mark.parametrize(("p_size", "d_size", "kv_heads"), [
    (1, 2, 4), (2, 1, 4), (2, 2, 4), (1, 4, 8), (4, 2, 8), (4, 1, 2), (1, 4, 2), (2, 4, 2)])
def test_routes_rebuild_each_consumer_rank(p_size: int, d_size: int, kv_heads: int):
    generator = torch.Generator().manual_seed(p_size * 10 + d_size)
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM, generator=generator)
    shape = dict(total_kv_heads=kv_heads, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                 dtype="float32", num_layers=LAYERS)
    producer = KVLayout.of_rank(p_size, 0, **shape)
    consumer = KVLayout.of_rank(d_size, 0, **shape)
    sources = rank_caches(full, producer)
    # D's caches start as NaN, so a head no route fills shows up.
    targets = [torch.full_like(cache, float("nan")) for cache in rank_caches(full, consumer)]
    p_blocks, d_blocks = [7, 2, 5], [1, 9, 0]
    p_ids, d_ids = block_ids_tensor(p_blocks, "cpu"), block_ids_tensor(d_blocks, "cpu")
    for route in plan_head_routes(producer, consumer):
        buffer = torch.empty(wire_shape(LAYERS, len(p_blocks),
                                        [BLOCK_SIZE, route.num_heads, HEAD_DIM]))
        gather_layers(sources[route.src_rank], 0, LAYERS, p_ids, buffer,
                      HeadSlice(route.src_head, route.num_heads))
        scatter_layers(targets[route.dst_rank], d_ids, buffer, 0,
                       HeadSlice(route.dst_head, route.num_heads))
    expected = rank_caches(full[:, :, p_blocks], consumer)
    for target, want in zip(targets, expected, strict=True):
        assert torch.equal(target[:, :, d_blocks], want)
        untouched = [b for b in range(BLOCKS) if b not in d_blocks]
        assert torch.isnan(target[:, :, untouched]).all()


def test_a_whole_slice_is_the_plain_copy():
    stacked = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    ids = block_ids_tensor([3, 1], "cpu")
    plain = torch.empty(wire_shape(2, 2, [BLOCK_SIZE, 2, HEAD_DIM]))
    sliced = torch.empty_like(plain)
    gather_layers(stacked, 1, 3, ids, plain)
    gather_layers(stacked, 1, 3, ids, sliced, HeadSlice(0, 2))
    assert torch.equal(plain, sliced)
    assert torch.equal(plain, stacked[1:3, :, [3, 1]])
