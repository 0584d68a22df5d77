"""Which KV heads move between which ranks when a producer and a consumer are split over
different tensor-parallel sizes: pure arithmetic, no device, socket or thread.

A worker of tensor-parallel size N keeps on rank r the KV heads ``kv_head_range`` gives it
(``engine_core/parallel/kv_layout.py``, the rule its cache and attention kernels follow).
``KVLayout`` (``engine_core/parallel/kv_layout.py``) is one rank's descriptor (what two
workers compare); ``plan_head_routes`` turns a
(producer layout, consumer layout) pair into ``HeadRoute`` s: for every head a consumer rank
holds, exactly one producer rank that sends it, even where either side replicates KV heads
over several ranks. Each producer rank therefore moves only heads it owns, straight to the
consumer ranks that keep them; no rank gathers another rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.parallel.kv_layout import (
    HeadSlice,
    KVLayout,
    KVLayoutError,
    PeerRanks,
    layout_mismatch,
)


@dataclass(frozen=True)
class HeadRoute:
    """Producer rank ``src_rank`` sends ``num_heads`` KV heads to consumer rank ``dst_rank``:
    its local heads ``[src_head, src_head + num_heads)`` land in the consumer's local heads
    ``[dst_head, dst_head + num_heads)``."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int

    @property
    def src_slice(self) -> HeadSlice:
        """What the producer rank gathers from each block."""
        return HeadSlice(self.src_head, self.num_heads)

    @property
    def dst_slice(self) -> HeadSlice:
        """Where the consumer rank scatters it."""
        return HeadSlice(self.dst_head, self.num_heads)


def plan_head_routes(producer: KVLayout, consumer: KVLayout) -> list[HeadRoute]:
    """Every (producer rank, consumer rank, head slice) move that fills all consumer ranks,
    sorted by consumer rank then head. Raises ``KVLayoutError`` for an unmappable pair.

    Where the producer replicates a KV head on several ranks, consumer rank ``j`` takes it
    from the ``j mod replicas``-th of them: one source per destination head, and equal
    layouts map each rank to itself.
    """
    reason = layout_mismatch(producer, consumer)
    if reason is not None:
        raise KVLayoutError(f"KV layouts cannot be mapped: {reason}")
    holders: dict[int, list[KVLayout]] = {}
    for rank in range(producer.tp_size):
        source = producer.rank_layout(rank)
        for head in range(source.kv_head_start, source.kv_head_start + source.num_kv_heads):
            holders.setdefault(head, []).append(source)
    routes: list[HeadRoute] = []
    for rank in range(consumer.tp_size):
        target = consumer.rank_layout(rank)
        for head in range(target.kv_head_start, target.kv_head_start + target.num_kv_heads):
            candidates = holders[head]
            source = candidates[rank % len(candidates)]
            src_head = head - source.kv_head_start
            dst_head = head - target.kv_head_start
            last = routes[-1] if routes else None
            if (last is not None and last.dst_rank == rank and last.src_rank == source.rank
                    and last.src_head + last.num_heads == src_head
                    and last.dst_head + last.num_heads == dst_head):
                routes[-1] = HeadRoute(source.rank, rank, last.src_head, last.dst_head,
                                       last.num_heads + 1)
            else:
                routes.append(HeadRoute(source.rank, rank, src_head, dst_head, 1))
    return routes


def routes_into(routes: list[HeadRoute], consumer_rank: int) -> list[HeadRoute]:
    """The moves that fill one consumer rank (what that rank pulls)."""
    return [route for route in routes if route.dst_rank == consumer_rank]


def routes_from(routes: list[HeadRoute], producer_rank: int) -> list[HeadRoute]:
    """The moves one producer rank serves."""
    return [route for route in routes if route.src_rank == producer_rank]


def route_transfer_ids(transfer_id: str, routes: list[HeadRoute]) -> list[str]:
    """Each route's own transfer id (each route is one ordinary transfer between two ranks:
    its own pull, header and data calls), named after the request's; a single route (TP=1
    <-> TP=1) keeps the request's id, so that path is unchanged on the wire."""
    if len(routes) == 1:
        return [transfer_id]
    return [f"{transfer_id}/kv{route.src_rank}-{route.dst_rank}" for route in routes]


def rank_pairs(transfer_id: str, producer: PeerRanks | None, producer_address: str,
               consumer: PeerRanks | None, consumer_address: str) -> list[tuple[str, str, str]]:
    """Each route of a transfer between two workers as (its transfer id, the producer rank's
    connector address, the consumer rank's): the pulls, and releases, it moves under. A
    worker whose ranks are not known is one rank at its address with the other's model shape
    (both unknown: the one pair of addresses)."""
    if producer is None and consumer is None:
        return [(transfer_id, producer_address, consumer_address)]
    shape = (producer or consumer).layout.model_shape  # type: ignore[union-attr]
    producer = producer or PeerRanks.one_rank(producer_address, shape)
    consumer = consumer or PeerRanks.one_rank(consumer_address, shape)
    routes = plan_head_routes(producer.layout, consumer.layout)
    return [(route_id, producer.addresses[route.src_rank], consumer.addresses[route.dst_rank])
            for route_id, route in zip(route_transfer_ids(transfer_id, routes), routes,
                                       strict=True)]
