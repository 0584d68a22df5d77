"""Rank 0's split and report combining against real connector workers, one a rank, over
the CPU transport: each side plans the request once against the peer's rank 0, splits it
into its ranks' routes (``rank_split.split_step``), and lands or hands back the request
once every rank reported (``RankReportCombiner``)."""

from __future__ import annotations

import pytest

from connectors.p2p_nccl.metadata import LoadSpec, P2pConnectorMetadata, SaveSpec
from connectors.p2p_nccl.rank_split import RouteGrants, split_step
from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.kv_connector import FinishedTransfers
from engine_core.parallel.kv_layout import PeerRanks
from engine_core.parallel.rank_reports import RankReportCombiner
from tests.connectors.layout_cluster import LAYERS, LayoutCluster
from tests.connectors.worker_pair import DST, SRC, wait_until
from tests.kv_grants import transfer_grant


@pytest.fixture
def cluster(request):
    made = LayoutCluster(*request.param)
    yield made
    made.shutdown()


def _combine_until(workers, combiner: RankReportCombiner, report, wanted: str
                   ) -> FinishedTransfers:
    combined = FinishedTransfers()

    def ended() -> bool:
        for rank, worker in enumerate(workers):
            done = combiner.add(rank, report(worker))
            combined.sending |= done.sending
            combined.recving |= done.recving
            combined.failed_recving |= done.failed_recving
        return wanted in combined.sending | combined.recving | combined.failed_recving

    assert wait_until(ended, 10.0), "the request never ended on every rank"
    return combined


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (2, 2), (1, 4)], indirect=True)
def test_split_plans_land_once_every_rank_did(cluster: LayoutCluster) -> None:
    grant = transfer_grant("t", cluster.p_addrs[0], cluster.d_addrs[0])
    d_plan = P2pConnectorMetadata(loads=[LoadSpec("req", "t", cluster.p_addrs[0], DST, 0, 12,
                                                  grant)])
    d_shares = split_step(d_plan, cluster.consumer,
                          {cluster.p_addrs[0]: PeerRanks(cluster.producer,
                                                         tuple(cluster.p_addrs))},
                          RouteGrants(tuple(cluster.d_addrs),
                                      GrantAuthority(ClusterSecret()).for_route))
    p_plan = P2pConnectorMetadata(saves=[SaveSpec("req", "t", cluster.d_addrs[0], SRC, 12)])
    p_shares = split_step(p_plan, cluster.producer,
                          {cluster.d_addrs[0]: PeerRanks(cluster.consumer,
                                                         tuple(cluster.d_addrs))})
    d_combiner, p_combiner = RankReportCombiner(), RankReportCombiner()
    d_combiner.expect_load("req", d_shares.load_ranks["req"])
    p_combiner.expect_send("req", p_shares.save_ranks["req"])

    for worker, share in zip(cluster.d_workers, d_shares.per_rank, strict=True):
        worker.start_load_kv(share)
    for worker, share in zip(cluster.p_workers, p_shares.per_rank, strict=True):
        worker.bind_step(share, None)
        for layer in range(LAYERS):
            worker.after_layer(layer, None)
        worker.wait_for_save()

    landed = _combine_until(cluster.d_workers, d_combiner, lambda w: w.land_loads(), "req")
    assert landed == FinishedTransfers(recving={"req"})
    cluster.assert_landed()
    sent = _combine_until(cluster.p_workers, p_combiner, lambda w: w.get_finished(), "req")
    assert sent.sending == {"req"}
    assert d_combiner.pending == p_combiner.pending == 0
    assert cluster.idle()
