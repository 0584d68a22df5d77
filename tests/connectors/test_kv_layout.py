"""The head mapping between tensor-parallel layouts (pure, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from connectors.p2p_nccl.kv_layout import (
    HeadRoute,
    plan_head_routes,
    route_transfer_ids,
    routes_from,
    routes_into,
)
from engine_core.parallel.kv_layout import KVLayout, KVLayoutError, check_layout, layout_mismatch


def layout(tp_size: int, kv_heads: int = 4, rank: int = 0, **shape: object) -> KVLayout:
    fields = {"head_dim": 8, "block_size": 16, "dtype": "float32", "num_layers": 2, **shape}
    return KVLayout.of_rank(tp_size, rank, kv_heads, **fields)


def assert_covers(producer: KVLayout, consumer: KVLayout, routes: list[HeadRoute]) -> None:
    """Every head of every consumer rank arrives exactly once, from a producer rank that
    holds that very head."""
    for rank in range(consumer.tp_size):
        target = consumer.rank_layout(rank)
        filled: list[int] = []
        for route in routes_into(routes, rank):
            source = producer.rank_layout(route.src_rank)
            assert 0 <= route.src_head and route.src_head + route.num_heads <= source.num_kv_heads
            for offset in range(route.num_heads):
                global_head = source.kv_head_start + route.src_head + offset
                assert global_head == target.kv_head_start + route.dst_head + offset
                filled.append(route.dst_head + offset)
        assert sorted(filled) == list(range(target.num_kv_heads))


def test_one_to_one_is_one_whole_route():
    routes = plan_head_routes(layout(1), layout(1))
    assert routes == [HeadRoute(0, 0, 0, 0, 4)]


def test_one_to_two_splits_the_heads():
    routes = plan_head_routes(layout(1), layout(2))
    assert routes == [HeadRoute(0, 0, 0, 0, 2), HeadRoute(0, 1, 2, 0, 2)]
    assert routes_from(routes, 0) == routes


def test_two_to_one_joins_the_heads():
    routes = plan_head_routes(layout(2), layout(1))
    assert routes == [HeadRoute(0, 0, 0, 0, 2), HeadRoute(1, 0, 0, 2, 2)]
    assert routes_into(routes, 0) == routes
    assert routes_from(routes, 1) == [HeadRoute(1, 0, 0, 2, 2)]


def test_equal_layouts_map_each_rank_to_itself():
    routes = plan_head_routes(layout(2), layout(2))
    assert routes == [HeadRoute(0, 0, 0, 0, 2), HeadRoute(1, 1, 0, 0, 2)]


def test_one_to_four_and_four_to_two():
    one_four = plan_head_routes(layout(1, 8), layout(4, 8))
    assert one_four == [HeadRoute(0, j, 2 * j, 0, 2) for j in range(4)]
    four_two = plan_head_routes(layout(4, 8), layout(2, 8))
    assert four_two == [HeadRoute(0, 0, 0, 0, 2), HeadRoute(1, 0, 0, 2, 2),
                        HeadRoute(2, 1, 0, 0, 2), HeadRoute(3, 1, 0, 2, 2)]
    assert_covers(layout(4, 8), layout(2, 8), four_two)


def test_replicated_heads_have_exactly_one_source():
    # Two KV heads over four ranks: ranks 0,1 hold head 0 and ranks 2,3 head 1.
    producer, consumer = layout(4, 2), layout(1, 2)
    routes = plan_head_routes(producer, consumer)
    assert routes == [HeadRoute(0, 0, 0, 0, 1), HeadRoute(2, 0, 0, 1, 1)]
    # Replicated on both sides: the layouts are equal, so each rank feeds itself.
    same = plan_head_routes(layout(4, 2), layout(4, 2))
    assert [(r.src_rank, r.dst_rank) for r in same] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # The consumer replicates: both holders of a head get it, each from one source.
    widen = plan_head_routes(layout(1, 2), layout(4, 2))
    assert widen == [HeadRoute(0, 0, 0, 0, 1), HeadRoute(0, 1, 0, 0, 1),
                     HeadRoute(0, 2, 1, 0, 1), HeadRoute(0, 3, 1, 0, 1)]


@pytest.mark.parametrize("sizes", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (4, 1),
                                   (2, 4), (4, 4), (8, 2), (2, 8)])
@pytest.mark.parametrize("kv_heads", [2, 4, 8])
def test_every_mappable_pair_is_covered(sizes: tuple[int, int], kv_heads: int):
    p_size, d_size = sizes
    producer, consumer = layout(p_size, kv_heads), layout(d_size, kv_heads)
    routes = plan_head_routes(producer, consumer)
    assert_covers(producer, consumer, routes)
    # Each producer rank moves at most one slice to each consumer rank (one data stream a pair).
    pairs = [(r.src_rank, r.dst_rank) for r in routes]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize(("change", "words"), [
    ({"head_dim": 16}, "head dim"),
    ({"block_size": 32}, "block size"),
    ({"dtype": "bfloat16"}, "cache dtype"),
    ({"num_layers": 3}, "layers"),
])
def test_different_model_shapes_are_refused(change: dict[str, object], words: str):
    with pytest.raises(KVLayoutError, match=words):
        plan_head_routes(layout(2), layout(1, **change))


def test_different_head_counts_and_unsplittable_sizes_are_refused():
    assert "KV heads differ" in layout_mismatch(layout(1, 4), layout(1, 8))
    # Three ranks cannot hold four KV heads: a peer claiming so is refused, not mapped.
    bogus = KVLayout(3, 0, 0, 1, 4, 8, 16, "float32", 2)
    with pytest.raises(KVLayoutError, match="do not split"):
        plan_head_routes(layout(1), bogus)
    assert "multiple" in check_layout(KVLayout(3, 0, 0, 1, 2, 8, 16, "float32", 2))


def test_a_descriptor_that_misstates_its_heads_is_refused():
    honest = layout(2, rank=1)
    assert check_layout(honest) is None
    assert "claims KV heads" in check_layout(replace(honest, kv_head_start=0))
    assert "out of range" in check_layout(replace(honest, rank=2))
    assert "positive" in check_layout(replace(honest, head_dim=0))


def test_route_transfer_ids_are_distinct_and_one_route_keeps_the_request_id():
    assert route_transfer_ids("r1", plan_head_routes(layout(1), layout(1))) == ["r1"]
    ids = route_transfer_ids("r1", plan_head_routes(layout(4, 8), layout(2, 8)))
    assert ids == ["r1/kv0-0", "r1/kv1-0", "r1/kv2-1", "r1/kv3-1"]
