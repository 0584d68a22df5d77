"""Routes between tensor-parallel layouts over real sockets (CPU transport), one connector
worker per rank (``layout_cluster.LayoutCluster``)."""

from __future__ import annotations

import pytest

from engine_core.worker.block_copy import HeadSlice
from tests.connectors.layout_cluster import LayoutCluster


@pytest.fixture
def make_cluster():
    clusters: list[LayoutCluster] = []

    def make(p_size: int, d_size: int) -> LayoutCluster:
        clusters.append(LayoutCluster(p_size, d_size))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.shutdown()


@pytest.mark.parametrize(("p_size", "d_size", "pull_first"),
                         [(2, 1, True), (1, 2, True), (2, 2, False), (1, 4, False)])
def test_every_consumer_rank_gets_its_heads(make_cluster, p_size: int, d_size: int,
                                            pull_first: bool):
    cluster = make_cluster(p_size, d_size)
    assert set(cluster.send("req", pull_first).values()) == {"ok"}
    cluster.assert_landed()
    assert cluster.idle()


def test_requests_in_turn_reuse_the_routes(make_cluster):
    cluster = make_cluster(2, 1)
    for index in range(4):  # pushed and deferred sends alternate on the same pairs
        cluster.d_caches_reset()
        assert set(cluster.send(f"req-{index}", pull_first=index % 2 == 0).values()) == {"ok"}
        cluster.assert_landed()
    assert cluster.idle()


def test_a_pull_for_other_heads_than_the_route_is_refused(make_cluster):
    cluster = make_cluster(1, 2)
    (wrong, _), (right, _) = cluster.named_routes("req")
    cluster.compute("req")
    cluster.ask("req", dst_heads={wrong: HeadSlice(0, 1)})  # asks 1 head of the route's 2
    outcomes = cluster.outcomes("req")
    assert outcomes[wrong] == "failed"
    assert outcomes[right] == "ok"
    assert cluster.p_workers[0].stats()["messages_rejected"] >= 1
    assert cluster.idle()
