"""Rank 0's split of one step's connector metadata into each rank's share: pure, no device,
socket or thread.

The scheduler side (rank 0) plans whole requests against the peer worker's rank 0. Between
tensor-parallel layouts each request moves as routes (``kv_layout.plan_head_routes``), each an
ordinary transfer between one producer rank's connector worker and one consumer rank's; this
module turns a request-level ``P2pConnectorMetadata`` into one per rank of this worker, with
each route's transfer id, the peer rank's address and the head slice this rank moves, and
records which ranks take part in each request so rank 0 can combine their reports
(``engine_core/parallel/rank_reports.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from connectors.p2p_nccl.kv_layout import HeadRoute, plan_head_routes, route_transfer_ids
from connectors.p2p_nccl.metadata import P2pConnectorMetadata, PeerNotice
from engine_core.parallel.kv_layout import KVLayout, PeerRanks


@dataclass(frozen=True)
class RouteGrants:
    """How a consumer's rank 0 grants its ranks' pulls between layouts: each of its ranks'
    connector addresses, rank 0 first, and ``issue`` (``GrantAuthority.for_route``: the
    request's checked grant, a route's transfer id, producer and consumer address -> the
    route's grant), as every producer rank checks a pull against its own address."""

    own_addresses: tuple[str, ...]
    issue: Callable[[str, str, str, str], str]


@dataclass
class RankShares:
    """Each rank's metadata for one step, and the ranks each request's transfers involve
    (what rank 0 waits for before it reports the request finished)."""

    per_rank: list[P2pConnectorMetadata]
    load_ranks: dict[str, frozenset[int]] = field(default_factory=dict)
    save_ranks: dict[str, frozenset[int]] = field(default_factory=dict)


def _named_routes(transfer_id: str, producer: KVLayout, consumer: KVLayout
                  ) -> list[tuple[str, HeadRoute]]:
    routes = plan_head_routes(producer, consumer)
    return list(zip(route_transfer_ids(transfer_id, routes), routes, strict=True))


def split_step(meta: P2pConnectorMetadata, own: KVLayout, peers: dict[str, PeerRanks],
               route_grants: RouteGrants | None = None) -> RankShares:
    """Each rank's share of ``meta`` (rank 0's plan against peers' rank-0 addresses).

    ``peers`` maps a peer's rank-0 address to its ranks; a spec naming an unknown peer is
    taken as a peer of one rank (TP=1) at that address. Raises ``KVLayoutError`` for a peer
    whose layout cannot be mapped onto ``own``. Every route carries its head slice, also
    where it moves all of a rank's heads, so both ends name the same slice. A pull (a load
    or a release) carries its route's grant from ``route_grants`` where the request moves in
    several routes (one route keeps the request's transfer id, addresses and grant); without
    ``route_grants`` it carries the request's.
    """
    shares = RankShares([P2pConnectorMetadata() for _ in range(own.tp_size)])

    def pull_grant(grant: str, transfer_id: str, producer: str, consumer_rank: int,
                   routes: int) -> str:
        if route_grants is None or routes == 1 or not grant:
            return grant
        return route_grants.issue(grant, transfer_id, producer,
                                  route_grants.own_addresses[consumer_rank])

    def peer_of(address: str) -> PeerRanks:
        peer = peers.get(address)
        if peer is not None:
            return peer
        return PeerRanks.one_rank(address, own.model_shape)

    for load in meta.loads:
        peer = peer_of(load.peer_address)
        named = _named_routes(load.transfer_id, peer.layout, own)
        for transfer_id, route in named:
            producer = peer.addresses[route.src_rank]
            shares.per_rank[route.dst_rank].loads.append(replace(
                load, transfer_id=transfer_id, peer_address=producer, heads=route.dst_slice,
                grant=pull_grant(load.grant, transfer_id, producer,
                                 route.dst_rank, len(named))))
        shares.load_ranks[load.request_id] = frozenset(route.dst_rank for _, route in named)
    for save in meta.saves:
        peer = peer_of(save.peer_address)
        named = _named_routes(save.transfer_id, own, peer.layout)
        for transfer_id, route in named:
            shares.per_rank[route.src_rank].saves.append(replace(
                save, transfer_id=transfer_id, peer_address=peer.addresses[route.dst_rank],
                heads=route.src_slice))
        shares.save_ranks[save.request_id] = frozenset(route.src_rank for _, route in named)
    for notice in meta.releases:  # consumer -> producer: each route from its consumer rank
        peer = peer_of(notice.peer_address)
        named = _named_routes(notice.transfer_id, peer.layout, own)
        for transfer_id, route in named:
            producer = peer.addresses[route.src_rank]
            shares.per_rank[route.dst_rank].releases.append(PeerNotice(
                transfer_id, producer, pull_grant(notice.grant, transfer_id, producer,
                                                  route.dst_rank, len(named))))
    for notice in meta.abandons:  # producer -> consumer: each route from its producer rank
        peer = peer_of(notice.peer_address)
        for transfer_id, route in _named_routes(notice.transfer_id, own, peer.layout):
            shares.per_rank[route.src_rank].abandons.append(
                PeerNotice(transfer_id, peer.addresses[route.dst_rank]))
    for share in shares.per_rank:
        share.cancels = list(meta.cancels)
    return shares
