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
from dataclasses import asdict, dataclass, field, fields, replace

from connectors.p2p_nccl.kv_layout import (
    HeadRoute,
    KVLayout,
    KVLayoutError,
    check_layout,
    plan_head_routes,
    route_transfer_ids,
)
from connectors.p2p_nccl.metadata import P2pConnectorMetadata, PeerNotice
from engine_core.addresses import is_host_port


@dataclass(frozen=True)
class RouteGrants:
    """How a consumer's rank 0 grants its ranks' pulls between layouts: each of its ranks'
    connector addresses, rank 0 first, and ``issue`` (``GrantAuthority.for_route``: the
    request's checked grant, a route's transfer id, producer and consumer address -> the
    route's grant), as every producer rank checks a pull against its own address."""

    own_addresses: tuple[str, ...]
    issue: Callable[[str, str, str, str], str]


@dataclass(frozen=True)
class PeerRanks:
    """A peer worker as transfers between layouts address it: its layout (any rank's; the
    model shape and size are what count) and each rank's connector address, rank 0 first."""

    layout: KVLayout
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.addresses) != self.layout.tp_size:
            raise KVLayoutError(f"peer of tensor-parallel size {self.layout.tp_size} gave "
                                f"{len(self.addresses)} rank addresses")

    def to_wire(self) -> dict[str, object]:
        """The form peers exchange (registration metadata, ``kv_transfer_params``)."""
        return {"layout": asdict(self.layout), "addresses": list(self.addresses)}

    @classmethod
    def from_wire(cls, value: object) -> PeerRanks:
        """A peer's ranks from the network, validated once here: raises ``KVLayoutError``
        naming what is wrong (missing or mistyped field, a layout no rank holds, an address
        that is not ``host:port``)."""
        if not isinstance(value, dict) or set(value) != {"layout", "addresses"}:
            raise KVLayoutError("peer ranks must be {layout, addresses}")
        raw, addresses = value["layout"], value["addresses"]
        names = [f.name for f in fields(KVLayout)]
        if not isinstance(raw, dict) or sorted(raw) != sorted(names):
            raise KVLayoutError(f"peer layout must have exactly the fields {names}")
        for name in names:
            kind = str if name == "dtype" else int
            if type(raw[name]) is not kind:
                raise KVLayoutError(f"peer layout field {name} must be {kind.__name__}")
        layout = KVLayout(**raw)
        reason = check_layout(layout)
        if reason is not None:
            raise KVLayoutError(f"peer layout: {reason}")
        if (not isinstance(addresses, list)
                or not all(is_host_port(address) for address in addresses)):
            raise KVLayoutError("peer rank addresses must be a list of host:port")
        return cls(layout, tuple(addresses))


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
        return PeerRanks(KVLayout.of_rank(1, 0, *own.model_shape), (address,))

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
