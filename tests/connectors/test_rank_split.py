"""Rank 0's split of a step's connector metadata into each rank's routes (pure)."""

from __future__ import annotations

import pytest

from connectors.p2p_nccl.kv_layout import plan_head_routes, rank_pairs
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, PeerNotice, SaveSpec
from connectors.p2p_nccl.rank_split import RouteGrants, split_step
from engine_core.parallel.kv_layout import HeadSlice, KVLayout, KVLayoutError, PeerRanks

P0 = "p:9000"


def layout(tp_size: int, kv_heads: int = 4, **shape: object) -> KVLayout:
    fields = {"head_dim": 8, "block_size": 16, "dtype": "float32", "num_layers": 2, **shape}
    return KVLayout.of_rank(tp_size, 0, kv_heads, **fields)


def peer(tp_size: int, kv_heads: int = 4, **shape: object) -> PeerRanks:
    return PeerRanks(layout(tp_size, kv_heads, **shape),
                     tuple(f"p:{9000 + rank}" for rank in range(tp_size)))


def load_step() -> P2pConnectorMetadata:
    return P2pConnectorMetadata(loads=[LoadSpec("r1", "t1", P0, [3, 4], 0, 20, "g-t1")],
                                releases=[PeerNotice("t0", P0, "g-t0")], cancels=["r9"])


def route_grants(d_size: int) -> RouteGrants:
    """Route grants spelled out, so a test sees which grant each pull carries."""
    return RouteGrants(tuple(f"d:{7000 + rank}" for rank in range(d_size)),
                       lambda grant, tid, producer, consumer: f"{grant}|{tid}|{producer}|{consumer}")


@pytest.mark.parametrize(("p_size", "d_size", "kv_heads"),
                         [(2, 1, 4), (1, 2, 4), (2, 2, 4), (1, 4, 2), (4, 1, 2), (4, 2, 8)])
def test_consumer_ranks_pull_every_head_once(p_size: int, d_size: int, kv_heads: int) -> None:
    own = layout(d_size, kv_heads)
    shares = split_step(load_step(), own, {P0: peer(p_size, kv_heads)})
    assert len(shares.per_rank) == d_size
    routes = plan_head_routes(layout(p_size, kv_heads), own)
    for rank, share in enumerate(shares.per_rank):
        heads = sorted((load.heads.start, load.heads.count) for load in share.loads)
        held = own.rank_layout(rank).num_kv_heads
        assert sum(count for _, count in heads) == held  # every head of the rank, once
        for load in share.loads:
            assert (load.request_id, load.block_ids, load.num_tokens) == ("r1", [3, 4], 20)
            src = int(load.peer_address.rsplit(":", 1)[1]) - 9000
            assert any(r.src_rank == src and r.dst_rank == rank and r.dst_slice == load.heads
                       for r in routes)
        assert len(share.releases) == len(share.loads)  # each route released by its puller
        assert share.cancels == ["r9"]
    ids = [load.transfer_id for share in shares.per_rank for load in share.loads]
    assert len(set(ids)) == len(routes)
    assert shares.load_ranks == {"r1": frozenset(range(d_size))}


def test_two_producer_ranks_fill_one_consumer() -> None:
    shares = split_step(load_step(), layout(1), {P0: peer(2)})
    [share] = shares.per_rank
    assert [(load.transfer_id, load.peer_address, load.heads) for load in share.loads] == [
        ("t1/kv0-0", "p:9000", HeadSlice(0, 2)),
        ("t1/kv1-0", "p:9001", HeadSlice(2, 2))]
    assert [(n.transfer_id, n.peer_address) for n in share.releases] == [
        ("t0/kv0-0", "p:9000"), ("t0/kv1-0", "p:9001")]


def test_producer_ranks_send_only_what_they_hold() -> None:
    """P TP=4 over 2 KV heads replicates each head twice; D TP=1 takes each head from one
    holder, so two producer ranks send nothing."""
    meta = P2pConnectorMetadata(saves=[SaveSpec("r1", "t1", "d:7000", [5], 15)],
                                abandons=[PeerNotice("t2", "d:7000")])
    d = PeerRanks(layout(1, 2), ("d:7000",))
    shares = split_step(meta, layout(4, 2), {"d:7000": d})
    senders = [rank for rank, share in enumerate(shares.per_rank) if share.saves]
    assert senders == [0, 2]
    assert shares.save_ranks == {"r1": frozenset({0, 2})}
    assert [[n.transfer_id for n in share.abandons] for share in shares.per_rank] == [
        ["t2/kv0-0"], [], ["t2/kv2-0"], []]
    for rank in senders:
        [save] = shares.per_rank[rank].saves
        assert save.heads == HeadSlice(0, 1) and save.peer_address == "d:7000"


def test_single_route_keeps_the_request_transfer_id() -> None:
    # unknown peer: TP=1 at that address
    shares = split_step(load_step(), layout(1), {}, route_grants(1))
    [share] = shares.per_rank
    [load] = share.loads
    assert (load.transfer_id, load.peer_address, load.heads) == ("t1", P0, HeadSlice(0, 4))
    assert load.grant == "g-t1" and [n.grant for n in share.releases] == ["g-t0"]


def test_each_route_pulls_under_its_own_grant() -> None:
    """A producer rank checks a pull's grant against its own address and the route's
    transfer id, so each route's load and release carry the route's grant."""
    shares = split_step(load_step(), layout(2), {P0: peer(2)}, route_grants(2))
    for rank, share in enumerate(shares.per_rank):
        for spec, grant in [(load, "g-t1") for load in share.loads] + [
                (notice, "g-t0") for notice in share.releases]:
            assert spec.grant == (f"{grant}|{spec.transfer_id}|{spec.peer_address}|"
                                  f"d:{7000 + rank}")
    # Without route grants every route carries the request's (one route between TP=1s).
    plain = split_step(load_step(), layout(2), {P0: peer(2)})
    assert {load.grant for share in plain.per_rank for load in share.loads} == {"g-t1"}


def test_unmappable_peer_is_refused() -> None:
    with pytest.raises(KVLayoutError, match="head dim"):
        split_step(load_step(), layout(2), {P0: peer(2, head_dim=16)})


def test_peer_must_name_every_rank() -> None:
    with pytest.raises(KVLayoutError, match="rank addresses"):
        PeerRanks(layout(2), ("p:9000",))


def test_peer_ranks_round_trip_the_wire() -> None:
    sent = peer(2)
    assert PeerRanks.from_wire(sent.to_wire()) == sent


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda wire: wire.pop("addresses"), "layout, addresses"),
    (lambda wire: wire["layout"].pop("dtype"), "exactly the fields"),
    (lambda wire: wire["layout"].update(head_dim="8"), "head_dim must be int"),
    (lambda wire: wire["layout"].update(num_kv_heads=True), "num_kv_heads must be int"),
    (lambda wire: wire["layout"].update(kv_head_start=1), "claims KV heads"),
    (lambda wire: wire["layout"].update(tp_size=3), "do not split"),
    (lambda wire: wire.update(addresses=["p:9000"]), "rank addresses"),
    (lambda wire: wire.update(addresses=["p:9000", "no-port"]), "host:port"),
])
def test_bad_peer_ranks_are_refused_clearly(mutate, reason: str) -> None:
    wire = peer(2).to_wire()
    mutate(wire)
    with pytest.raises(KVLayoutError, match=reason):
        PeerRanks.from_wire(wire)


@pytest.mark.parametrize(("p_size", "d_size", "kv_heads"),
                         [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (1, 4, 2), (4, 1, 2),
                          (4, 2, 8), (2, None, 4), (None, 2, 4), (None, None, 4)])
def test_release_pairs_name_what_the_producer_ranks_saved(p_size: int | None,
                                                          d_size: int | None,
                                                          kv_heads: int) -> None:
    """What the proxy releases (``rank_pairs``: route id, producer rank, consumer rank) is
    exactly what each producer rank saved for the consumer (``split_step``); a side that
    registered no ranks (None) is one rank at its address."""
    p_ranks = None if p_size is None else PeerRanks(
        layout(p_size, kv_heads), tuple(f"q:{8000 + r}" for r in range(p_size)))
    d_ranks = None if d_size is None else PeerRanks(
        layout(d_size, kv_heads), tuple(f"d:{7000 + r}" for r in range(d_size)))
    d0 = "d:7000"
    step = P2pConnectorMetadata(saves=[SaveSpec("r1", "t1", d0, [3, 4], 20)])
    own = layout(p_size or 1, kv_heads)
    shares = split_step(step, own, {} if d_ranks is None else {d0: d_ranks})
    p_addresses = (p_ranks.addresses if p_ranks is not None else ("q:8000",))
    saved = {(save.transfer_id, p_addresses[rank], save.peer_address)
             for rank, share in enumerate(shares.per_rank) for save in share.saves}
    released = rank_pairs("t1", p_ranks, "q:8000", d_ranks, d0)
    assert len(released) == len(set(released))
    assert set(released) == saved
