"""A tensor-parallel worker's connector: the scheduler side splits each step into its ranks'
shares against the peer's ranks named in the request's params (refusing an unmappable peer),
and rank 0's connector worker hands the shares out and reports a request once every rank it
involves ended its part."""

from __future__ import annotations

from connectors.p2p_nccl.connector_worker import P2pConnectorWorker
from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connectors.p2p_nccl.rank_group import RankZeroConnectorWorker
from connectors.p2p_nccl.rank_split import RankShares
from connectors.p2p_nccl.scheduler_side import P2pConnectorScheduler
from engine_core.config import KVTransferConfig
from engine_core.doorbell import Doorbell
from engine_core.kv_connector import FinishedTransfers, RankZeroConnector
from engine_core.parallel.kv_layout import HeadSlice, KVLayout, PeerRanks
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import SchedulerOutput
from tests.kv_grants import granted_params

BS = 4
OWN = "127.0.0.1:14579"


def ranks(tp_size: int, first_port: int, kv_heads: int = 2, dtype: str = "float32") -> PeerRanks:
    return PeerRanks(KVLayout.of_rank(tp_size, 0, kv_heads, 8, BS, dtype, 2),
                     tuple(f"127.0.0.1:{first_port + r}" for r in range(tp_size)))


def consumer_request(peer: PeerRanks | None) -> Request:
    wire = {"transfer_id": "T", "do_remote_prefill": True,
            "remote_kv_address": "127.0.0.1:9000"}
    if peer is not None:
        wire["remote_ranks"] = peer.to_wire()
    return Request(request_id="r", prompt_token_ids=list(range(3 * BS + 1)),
                   sampling_params=SamplingParams(max_tokens=1),
                   kv_transfer_params=granted_params(wire, OWN))


def plan_load(sched: P2pConnectorScheduler, peer: PeerRanks | None):
    request = consumer_request(peer)
    match = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, [5, 6, 7, 8], 0, match.num_tokens)
    return match, sched.build_connector_meta(SchedulerOutput([], [], {}, 0))


def test_one_rank_consumer_pulls_each_producer_rank_its_heads() -> None:
    sched = P2pConnectorScheduler(KVTransferConfig(kv_role="kv_consumer"), BS, ranks(1, 14579))
    match, meta = plan_load(sched, ranks(2, 9000))
    assert match.is_async and isinstance(meta, P2pConnectorMetadata)
    assert [(load.transfer_id, load.peer_address, load.heads) for load in meta.loads] == [
        ("T/kv0-0", "127.0.0.1:9000", HeadSlice(0, 1)),
        ("T/kv1-0", "127.0.0.1:9001", HeadSlice(1, 1))]
    assert meta.loads[0].grant != meta.loads[1].grant  # each route's own grant


def test_two_rank_consumer_gives_each_rank_its_share() -> None:
    sched = P2pConnectorScheduler(KVTransferConfig(kv_role="kv_consumer"), BS, ranks(2, 14579))
    _, shares = plan_load(sched, None)  # a peer without ranks: one rank at its address
    assert isinstance(shares, RankShares)
    assert [len(share.loads) for share in shares.per_rank] == [1, 1]
    assert shares.load_ranks == {"r": frozenset({0, 1})}


def test_an_unmappable_peer_moves_no_kv() -> None:
    sched = P2pConnectorScheduler(KVTransferConfig(kv_role="kv_consumer"), BS, ranks(1, 14579))
    match, meta = plan_load(sched, ranks(1, 9000, dtype="bfloat16"))
    assert not match.is_async and not meta.loads  # the prompt is computed here
    assert sched.stats()["invalid_transfer_params"] == 1


class FakeWorker:
    """Rank 0's own connector worker: reports what the test queues."""

    def __init__(self) -> None:
        self.landed = FinishedTransfers()
        self.finished = FinishedTransfers()
        self.bell = Doorbell()

    def land_loads(self) -> FinishedTransfers:
        out, self.landed = self.landed, FinishedTransfers()
        return out

    def get_finished(self) -> FinishedTransfers:
        out, self.finished = self.finished, FinishedTransfers()
        return out

    def doorbell(self) -> Doorbell:
        return self.bell

    def is_idle(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {"bytes_received": 10.0, "loads_in_flight": 0.0}


def shares_of(load_ranks: dict[str, frozenset[int]], save_ranks: dict[str, frozenset[int]],
              per_rank: list[P2pConnectorMetadata]) -> RankShares:
    return RankShares(per_rank, load_ranks, save_ranks)


def test_rank_zero_hands_out_shares_and_reports_once_every_rank_ended() -> None:
    own = FakeWorker()
    group = RankZeroConnectorWorker(own, 3)  # type: ignore[arg-type]
    assert isinstance(group, RankZeroConnector)
    load = LoadSpec("r", "T/kv0-1", "p:1", [1], 0, 4, "g", HeadSlice(0, 1))
    save = SaveSpec("s", "U/kv1-0", "d:1", [2], 4, HeadSlice(0, 1))
    encoded = group.rank_shares(shares_of(
        {"r": frozenset({0, 1})}, {"s": frozenset({1})},
        [P2pConnectorMetadata(), P2pConnectorMetadata(loads=[load], saves=[save]),
         P2pConnectorMetadata()]))
    assert encoded[0] is not None and encoded[1] is None  # ranks 1 and 2: rank 2 has none
    decoded = P2pConnectorWorker.decode_share(encoded[0])
    assert decoded.loads == [load] and decoded.saves == [save]

    own.landed = FinishedTransfers(recving={"r"})
    assert group.land_loads() == FinishedTransfers()  # rank 1 may still write its heads
    assert not group.is_idle()
    group.add_rank_report(1, FinishedTransfers(sending={"s"}, recving={"r"}),
                          {"bytes_received": 5.0, "loads_in_flight": 1.0}, False)
    stats = group.stats()  # the worker's: every rank's summed
    assert (stats["bytes_received"], stats["loads_in_flight"]) == (15.0, 1.0)
    assert group.land_loads() == FinishedTransfers(recving={"r"})  # the send waits for ...
    assert group.get_finished() == FinishedTransfers(sending={"s"})  # ... get_finished
    assert not group.is_idle()  # rank 1 still holds transfer state
    group.add_rank_report(1, FinishedTransfers(), {"bytes_received": 5.0}, True)
    assert group.get_finished() == FinishedTransfers()
    assert group.is_idle()


def test_a_lost_rank_fails_the_loads_waiting_on_it() -> None:
    own = FakeWorker()
    group = RankZeroConnectorWorker(own, 2)  # type: ignore[arg-type]
    group.rank_shares(shares_of({"r": frozenset({0, 1})}, {}, [P2pConnectorMetadata()] * 2))
    own.landed = FinishedTransfers(recving={"r"})
    assert group.land_loads() == FinishedTransfers()
    group.rank_lost(1)
    assert group.land_loads() == FinishedTransfers(failed_recving={"r"})
    group.add_rank_report(1, FinishedTransfers(recving={"late"}), {}, True)  # lost: unheard
    assert group.get_finished() == FinishedTransfers()
